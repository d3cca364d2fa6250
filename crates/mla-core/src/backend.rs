//! The interface every compute backend (cpu, cuda) implements.

use crate::config::ModelConfig;
use crate::plan::{StepOutput, StepPlan};

/// Shape of the paged latent KV cache a backend owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// A model on some device with its own KV cache. The engine drives it one `StepPlan` at a time
/// from a single thread; the backend never sees requests, strings or HTTP.
pub trait Backend: Send {
    /// Short description for logs, e.g. "cpu (16 threads)".
    fn device_name(&self) -> String;
    fn model_config(&self) -> &ModelConfig;
    fn cache_layout(&self) -> CacheLayout;
    /// Runs one step. Writes the latent cache for every fed token, then returns logits and
    /// sampled tokens as the plan asks. An error leaves the cache contents of the fed positions
    /// unspecified but everything else intact.
    fn step(&mut self, plan: &StepPlan) -> anyhow::Result<StepOutput>;
}
