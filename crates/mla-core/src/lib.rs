//! The ground floor of mla-serve, in three parts whose imports point one way only
//! (`scripts/module_cycles.py` checks it):
//! - `model`: the model description: the typed config, the checkpoint's tensors and how a
//!   parallel layout cuts them, where weights come from (checkpoints, dummy, block FP8);
//! - `step`: the step contract between the engine and a backend, on top of the model: the plan
//!   of a step, the `Backend` trait, the largest step a backend runs, structured-output masks;
//! - `runtime`: threads, collectives without NCCL, groups of ranks and nodes, on top of both.
//!
//! Beside them, leaf utilities: the reference sampler (`sampling`) and a seeded generator (`rng`).
//! Nothing here knows about devices, HTTP or tokenizers.

pub mod model;
pub mod rng;
pub mod runtime;
pub mod sampling;
pub mod speculative;
pub mod step;

pub use model::checkpoint::Checkpoint;
pub use model::config::{ConfigError, ModelConfig};
pub use model::dummy::DummyWeights;
pub use model::latent_fp8::KvCacheDtype;
pub use model::parallel::{Parallel, RankLayout, Shard};
pub use model::weight_source::{CheckpointError, Fp8Tensor, WeightSource};
pub use model::weights::{ModelSpec, MtpSpec, Split, TensorRole, TensorSpec};
pub use rng::SplitMix64;
pub use step::backend::{Backend, CacheLayout, FatalBackendError, PendingStep};
pub use step::limits::{StepBudget, StepLimits};
pub use step::plan::{
    LogitsRequest, SampleRequest, SampledToken, SamplingParams, SeqResult, SeqStep, StepKind, StepOutput, StepPlan,
};
