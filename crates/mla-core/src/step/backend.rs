//! The interface every compute backend (cpu, cuda; one device or several) implements.

use crate::model::config::ModelConfig;
use crate::step::limits::StepLimits;
use crate::step::plan::{StepOutput, StepPlan};
use std::sync::Arc;

/// Shape of a paged latent KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheLayout {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks available to the block manager.
    pub num_blocks: usize,
}

impl CacheLayout {
    pub fn capacity_tokens(&self) -> usize {
        self.block_size * self.num_blocks
    }
}

/// A model on some devices with its KV caches. The engine drives it one step at a time from a
/// single thread; the backend never sees requests, strings or HTTP.
///
/// A step is one `StepPlan` per attention rank: a backend has one attention rank, or, under DP
/// attention, one per device, each with its own KV cache (`cache_layouts`). Plans of one step may
/// differ in kind. An empty plan leaves its rank idle, and the rank still takes part in every
/// collective of the step.
pub trait Backend: Send {
    /// Short description for logs, e.g. "cpu (16 threads)".
    fn device_name(&self) -> String;
    fn model_config(&self) -> &ModelConfig;
    /// The KV cache of each attention rank, in rank order.
    fn cache_layouts(&self) -> Vec<CacheLayout>;
    /// The largest step each attention rank may run (`StepLimits`): the engine schedules within
    /// it, and the backend refuses a step outside it before any rank starts.
    fn step_limits(&self) -> StepLimits;

    /// Starts a step: `plans[r]` on attention rank r (`plans.len() == cache_layouts().len()`).
    /// Each rank writes the latent cache for every token it feeds, then returns logits and
    /// sampled tokens as its plan asks. Returns at once: a backend with threads of its own
    /// hands them the step, one that computes on the caller's thread keeps it for
    /// `finish_step` (`PendingStep`), so the engine can deliver the previous step's tokens
    /// before the devices or the CPU work on this one. `finish_step` gives the outputs,
    /// one per rank, before another step starts.
    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>);

    /// The outputs of the step `start_step` started. An error leaves the cache contents of the
    /// fed positions unspecified and everything else intact, unless it is a
    /// `FatalBackendError`: then the backend cannot run another step.
    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>>;

    /// Whether the backend verifies drafts of sampled (non-greedy) draws by rejection sampling;
    /// without it the engine drafts for greedy requests only.
    fn verifies_sampled_drafts(&self) -> bool {
        false
    }

    /// Whether the backend verifies drafts of requests with penalties, `logit_bias` or a
    /// structured-output grammar, each verify row shaped by the drafts before it (its penalties
    /// and its own mask, `speculative::row_request`); without it the engine does not draft for
    /// them.
    fn verifies_shaped_drafts(&self) -> bool {
        false
    }

    /// Whether the backend copies blocks as `SeqStep::fork` asks, before the step writes; without
    /// it the engine never asks, and the completions of an `n`-way request each compute the
    /// prompt's last block instead of its last token.
    fn forks_blocks(&self) -> bool {
        false
    }

    /// One step of a backend with one attention rank (tests, benchmarks).
    fn step(&mut self, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        self.start_step(&Arc::new(vec![plan.clone()]));
        let mut outs = self.finish_step()?;
        anyhow::ensure!(outs.len() == 1, "Backend::step is for one attention rank; this backend has {}", outs.len());
        Ok(outs.pop().expect("checked"))
    }
}

/// A failure after which a backend cannot run another step: a rank died, a collective broke, a
/// step hung past its watchdog. The engine fails every request and stops rather than retrying.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct FatalBackendError(pub String);

/// The step a backend that computes on the engine's thread holds from `start_step` until
/// `finish_step` runs it. Computing in `finish_step` rather than `start_step` lets the engine
/// deliver the previous step's tokens first, as it does while a threaded backend computes.
#[derive(Default)]
pub struct PendingStep(Option<Arc<Vec<StepPlan>>>);

impl PendingStep {
    pub fn set(&mut self, plans: &Arc<Vec<StepPlan>>) {
        assert!(self.0.is_none(), "start_step while a step is in flight; call finish_step first");
        self.0 = Some(plans.clone());
    }

    pub fn take(&mut self) -> anyhow::Result<Arc<Vec<StepPlan>>> {
        self.0.take().ok_or_else(|| anyhow::anyhow!("finish_step without a started step"))
    }
}
