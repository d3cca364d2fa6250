//! Core types of mla-serve: the typed model config, checkpoint access, the per-step plan a
//! scheduler hands to a backend, the backend interface, RoPE/YaRN math and the reference sampler.
//! Nothing in this crate knows about devices, HTTP or tokenizers.

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod dummy;
pub mod fp8;
pub mod plan;
pub mod rng;
pub mod rope;
pub mod sampling;
pub mod weight_source;
pub mod weights;

pub use backend::{Backend, CacheLayout};
pub use checkpoint::Checkpoint;
pub use config::{ConfigError, ModelConfig};
pub use dummy::DummyWeights;
pub use plan::{
    LogitsRequest, SampleRequest, SampledToken, SamplingParams, SeqResult, SeqStep, StepKind, StepOutput, StepPlan,
};
pub use rng::SplitMix64;
pub use weight_source::{CheckpointError, Fp8Tensor, WeightSource};
pub use weights::{ModelSpec, TensorRole, TensorSpec};
