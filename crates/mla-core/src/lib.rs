//! Core types of mla-serve: the typed model config, checkpoint access, the per-step plan a
//! scheduler hands to a backend, the backend interface and the reference sampler.
//! Nothing in this crate knows about devices, HTTP or tokenizers.

pub mod backend;
pub mod config;
pub mod plan;
pub mod sampling;

pub use backend::{Backend, CacheLayout};
pub use config::{ConfigError, ModelConfig};
pub use plan::{LogitsRequest, SampleRequest, SampledToken, SeqResult, SeqStep, StepKind, StepOutput, StepPlan};
pub use sampling::SamplingParams;
