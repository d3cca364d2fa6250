//! `CpuBackend`: one rank holding the whole model, behind mla-core's `Backend` trait. It computes
//! on the engine's thread, in `finish_step`.

use crate::kv_cache::LatentCache;
use crate::model::{CpuModel, Peers};
use crate::rank::CpuRank;
use mla_core::runtime::collective::Solo;
use mla_core::speculative::mtp_pass_counts;
use mla_core::step::plan::{StepOutput, StepPlan};
use mla_core::{Backend, CacheLayout, KvCacheDtype, ModelConfig, PendingStep, RankLayout, StepLimits, WeightSource};
use std::sync::Arc;

pub struct CpuBackend {
    rank: CpuRank,
    pending: PendingStep,
    /// The steps it accepts: the server gives it the same step limits a GPU would get, so a step the
    /// engine should not have built fails here too (`StepLimits::check`).
    step_limits: StepLimits,
}

impl CpuBackend {
    /// Loads `cfg`'s weights from `weights` (a checkpoint or dummy weights) and allocates a
    /// zeroed latent cache of `num_blocks` blocks of `block_size` tokens per layer.
    pub fn new(
        cfg: ModelConfig,
        weights: &dyn WeightSource,
        block_size: usize,
        num_blocks: usize,
    ) -> anyhow::Result<Self> {
        Self::with_cache_dtype(cfg, weights, block_size, num_blocks, KvCacheDtype::Auto)
    }

    /// As `new`, with a latent cache of `kv_dtype` (f32 values or FP8 rows).
    pub fn with_cache_dtype(
        cfg: ModelConfig,
        weights: &dyn WeightSource,
        block_size: usize,
        num_blocks: usize,
        kv_dtype: KvCacheDtype,
    ) -> anyhow::Result<Self> {
        tracing::info!(source = %weights.describe(), block_size, num_blocks, kv_cache_dtype = kv_dtype.name(), "loading cpu backend");
        let rank = CpuRank::new(cfg, weights, RankLayout::SINGLE, block_size, num_blocks, kv_dtype)?;
        Ok(CpuBackend { rank, pending: PendingStep::default(), step_limits: StepLimits::unlimited() })
    }

    /// Loads the model's MTP layer so steps may ask for speculative decoding.
    pub fn with_mtp(mut self, weights: &dyn WeightSource) -> anyhow::Result<Self> {
        self.rank.enable_mtp(weights, RankLayout::SINGLE)?;
        Ok(self)
    }

    /// Accepts only steps within `step_limits` (unlimited by default).
    pub fn with_step_limits(self, step_limits: StepLimits) -> Self {
        CpuBackend { step_limits, ..self }
    }

    pub fn model(&self) -> &CpuModel {
        self.rank.model()
    }

    /// Read access to the latent cache (tests and cross-backend checks).
    pub fn cache(&self) -> &LatentCache {
        self.rank.cache()
    }

    /// Write access to the latent cache (tests that plant faults in it).
    pub fn cache_mut(&mut self) -> &mut LatentCache {
        self.rank.cache_mut()
    }

    fn run(&mut self, plans: &[StepPlan]) -> anyhow::Result<Vec<StepOutput>> {
        anyhow::ensure!(plans.len() == 1, "the CPU backend has one attention rank; the step has {}", plans.len());
        let plan = &plans[0];
        self.rank.validate(plan)?;
        self.step_limits.check(plans)?;
        let counts = [plan.num_tokens()];
        let passes = mtp_pass_counts(plans);
        Ok(vec![self.rank.run(plan, Peers { comm: &mut Solo, counts: &counts }, &passes)?])
    }
}

impl Backend for CpuBackend {
    fn verifies_sampled_drafts(&self) -> bool {
        true
    }

    fn forks_blocks(&self) -> bool {
        true
    }

    fn verifies_shaped_drafts(&self) -> bool {
        true
    }

    fn device_name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn model_config(&self) -> &ModelConfig {
        self.rank.model().config()
    }

    fn cache_layouts(&self) -> Vec<CacheLayout> {
        vec![self.rank.cache_layout()]
    }

    fn step_limits(&self) -> StepLimits {
        self.step_limits
    }

    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        self.pending.set(plans);
    }

    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        let plans = self.pending.take()?;
        self.run(&plans)
    }
}
