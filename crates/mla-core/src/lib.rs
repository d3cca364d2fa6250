//! Core types of mla-serve: the typed model config, checkpoint access, the per-step plan a
//! scheduler hands to a backend, the backend interface and the reference sampler.
//! Nothing in this crate knows about devices, HTTP or tokenizers.

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod dummy;
pub mod fp8;
pub mod plan;
pub mod sampling;
pub mod weight_source;
pub mod weights;

pub use backend::{Backend, CacheLayout};
pub use checkpoint::{Checkpoint, CheckpointError};
pub use config::{ConfigError, ModelConfig};
pub use dummy::DummyWeights;
pub use plan::{LogitsRequest, SampleRequest, SampledToken, SeqResult, SeqStep, StepKind, StepOutput, StepPlan};
pub use sampling::SamplingParams;
pub use weight_source::{Fp8Tensor, WeightSource};
pub use weights::{ModelSpec, TensorRole, TensorSpec};
