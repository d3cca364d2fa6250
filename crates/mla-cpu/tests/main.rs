//! mla-cpu's integration tests against HF transformers' fixtures and against itself across
//! layouts, one module per concern (each module's doc says what it checks), in one test binary:
//! `cargo test -p mla-cpu --test cpu -- hf_fixtures::` runs one module. `common` loads the
//! fixtures they share.

mod common;
mod fp8_cache_accuracy;
mod hf_fixtures;
mod mtp_oracle;
mod paging_and_batching;
mod parallel;
mod routing;
mod speculative_sampling;
mod speculative_steps;
