//! Core types of mla-serve: the typed model config, checkpoint access, the per-step plan a
//! scheduler hands to a backend, the backend interface, RoPE/YaRN math and the reference sampler.
//! Nothing in this crate knows about devices, HTTP or tokenizers.

pub mod agreement;
pub mod backend;
pub mod checkpoint;
pub mod cluster;
pub mod collective;
pub mod config;
pub mod dummy;
pub mod fault;
pub mod fd_limit;
pub mod fp8;
pub mod fp8_source;
pub mod group;
pub mod json_patch;
pub mod parallel;
pub mod plan;
pub mod rng;
pub mod rope;
pub mod sampling;
pub mod step_limits;
pub mod step_thread;
pub mod token_mask;
pub mod weight_source;
pub mod weights;

pub use backend::{Backend, CacheLayout, FatalBackendError, PendingStep};
pub use checkpoint::Checkpoint;
pub use config::{ConfigError, ModelConfig};
pub use dummy::DummyWeights;
pub use parallel::{Parallel, RankLayout, Shard};
pub use plan::{
    LogitsRequest, SampleRequest, SampledToken, SamplingParams, SeqResult, SeqStep, StepKind, StepOutput, StepPlan,
};
pub use rng::SplitMix64;
pub use step_limits::{StepBudget, StepLimits};
pub use weight_source::{CheckpointError, Fp8Tensor, WeightSource};
pub use weights::{ModelSpec, Split, TensorRole, TensorSpec};
