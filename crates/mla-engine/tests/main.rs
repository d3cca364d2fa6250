//! mla-engine's integration tests, one module per concern (each module's doc says what it
//! checks), in one test binary: `cargo test -p mla-engine --test engine -- scheduler::` runs one
//! module. `common` holds the scripted backends and the cache-free reference they share.

mod block_manager;
mod cache_index;
mod common;
mod constrained;
mod engine;
mod engine_lifecycle;
mod engine_pipelined;
mod finish_choice;
mod forks;
mod parallel_engine;
mod prefix_cache;
mod prefix_routing;
mod prompt_logprobs;
mod scheduler;
mod speculative;
