//! `CpuGroupBackend`: the CPU reference for the multi-GPU backends. `world` ranks, each a thread
//! with its part of the model, its own latent cache and one rank of a `ThreadGroup`, run every
//! step together, exactly as the GPU ranks do with NCCL:
//! - tensor parallelism: every rank runs the engine's one plan with its share of the heads and
//!   FFN widths; the ranks all-reduce partial sums, so all of them compute the same tokens and
//!   rank 0's output is the answer (the others' are checked against it);
//! - DP attention: rank r runs plan r, for its own requests and cache; an empty plan is an idle
//!   rank, which still makes every collective of the step.
//!
//! It is the correctness reference (`--device cpu` accepts `--tp` and `--enable-dp-attention`
//! for this), not a fast path: every rank computes on the same CPU cores.

use crate::model::Peers;
use crate::rank::CpuRank;
use mla_core::collective::{ThreadGroup, ThreadRank};
use mla_core::plan::{StepOutput, StepPlan};
use mla_core::step_thread::{StepRunner, StepShape, StepSize, StepThread};
use mla_core::{Backend, CacheLayout, FatalBackendError, ModelConfig, Parallel, WeightSource};
use std::sync::Arc;
use std::time::Duration;

pub struct CpuGroupBackend {
    cfg: ModelConfig,
    parallel: Parallel,
    ranks: Vec<StepThread<RankWorker>>,
    /// One per attention rank.
    layouts: Vec<CacheLayout>,
    /// Why the step in flight could not start (a plan that does not fit), or None.
    refused: Option<anyhow::Error>,
    /// A rank failed: the group's collectives are broken for good.
    broken: Option<String>,
}

/// What every rank gets for one step.
struct GroupStep {
    plans: Arc<Vec<StepPlan>>,
    /// Tokens each rank feeds (DP attention).
    counts: Vec<usize>,
}

impl StepSize for GroupStep {
    fn size(&self) -> StepShape {
        self.plans.as_ref().size()
    }
}

struct RankWorker {
    rank: CpuRank,
    comm: ThreadRank,
    /// The plan this rank runs: its own under DP attention, the one shared plan otherwise.
    plan_index: usize,
    index: usize,
    steps: u64,
}

impl StepRunner for RankWorker {
    type Step = GroupStep;
    type Output = StepOutput;

    fn run_step(&mut self, step: &GroupStep) -> anyhow::Result<StepOutput> {
        self.steps += 1;
        mla_core::fault::maybe_kill(self.index, self.steps);
        let plan = &step.plans[self.plan_index];
        self.rank.run(plan, Peers { comm: &mut self.comm, counts: &step.counts })
    }
}

impl CpuGroupBackend {
    /// `parallel.ranks()` ranks of `cfg` (checked with `Parallel::check`), weights from
    /// `weights`, each attention rank with a cache of `num_blocks` blocks of `block_size` tokens.
    /// A rank that waits longer than `timeout` for the others inside one collective (a rank
    /// stuck or gone) fails the group; CPU ranks of a DP-attention step may differ by a whole
    /// prefill chunk of work, so it should be generous.
    pub fn new(
        cfg: ModelConfig,
        weights: Arc<dyn WeightSource + Send + Sync>,
        parallel: Parallel,
        cache: CacheLayout,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let CacheLayout { block_size, num_blocks } = cache;
        parallel.check(&cfg)?;
        anyhow::ensure!(
            parallel.replicas == 1,
            "a CpuGroupBackend is one copy of the model; replicas are separate backends"
        );
        let world = parallel.ranks();
        tracing::info!(
            source = %weights.describe(),
            ranks = world,
            dp_attention = parallel.dp_attention,
            block_size,
            num_blocks,
            "loading cpu group backend"
        );
        let inits: Vec<_> = ThreadGroup::ranks(world, timeout)
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let (cfg, weights) = (cfg.clone(), weights.clone());
                let layout = parallel.rank(r);
                let init = move || {
                    let rank = CpuRank::new(cfg, weights.as_ref(), layout, block_size, num_blocks)?;
                    let plan_index = if layout.dp_attention { r } else { 0 };
                    let cache = rank.cache_layout();
                    Ok((RankWorker { rank, comm, plan_index, index: r, steps: 0 }, cache))
                };
                (format!("cpu-rank-{r}"), init)
            })
            .collect();
        let started = StepThread::spawn_group(inits)?;
        let layouts: Vec<CacheLayout> = started.iter().map(|(_, l)| *l).take(parallel.attention_ranks()).collect();
        let ranks = started.into_iter().map(|(t, _)| t).collect();
        Ok(CpuGroupBackend { cfg, parallel, ranks, layouts, refused: None, broken: None })
    }

    /// Checks every plan before any rank starts: a rank that refused its plan after the others
    /// entered a collective would leave them waiting.
    fn check(&self, plans: &[StepPlan]) -> anyhow::Result<()> {
        anyhow::ensure!(
            plans.len() == self.layouts.len(),
            "the step has {} plans for {} attention ranks",
            plans.len(),
            self.layouts.len()
        );
        for (plan, l) in plans.iter().zip(&self.layouts) {
            plan.validate(l.block_size, l.num_blocks, self.cfg.vocab_size, self.cfg.max_position_embeddings)?;
        }
        Ok(())
    }
}

impl Backend for CpuGroupBackend {
    fn device_name(&self) -> String {
        let mode = if self.parallel.dp_attention { "DP attention" } else { "tensor parallel" };
        format!("cpu ({} ranks, {mode}, {} threads)", self.parallel.ranks(), rayon::current_num_threads())
    }

    fn model_config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layouts(&self) -> Vec<CacheLayout> {
        self.layouts.clone()
    }

    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        if let Err(e) = self.check(plans) {
            self.refused = Some(e);
            return;
        }
        let counts = if self.parallel.dp_attention { plans.iter().map(|p| p.num_tokens()).collect() } else { vec![] };
        let step = Arc::new(GroupStep { plans: plans.clone(), counts });
        for r in &mut self.ranks {
            r.start_step(&step);
        }
    }

    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        if let Some(e) = self.refused.take() {
            return Err(e);
        }
        if let Some(why) = &self.broken {
            return Err(FatalBackendError(format!("the CPU rank group stopped earlier: {why}")).into());
        }
        let results: Vec<anyhow::Result<StepOutput>> = self.ranks.iter_mut().map(|r| r.finish_step()).collect();
        // Every failing rank is named: the one that died and the ones its death broke.
        let failures: Vec<String> = results
            .iter()
            .enumerate()
            .filter_map(|(r, res)| res.as_ref().err().map(|e| format!("rank {r}: {e:#}")))
            .collect();
        if !failures.is_empty() {
            let why = failures.join("; ");
            self.broken = Some(why.clone());
            return Err(FatalBackendError(why).into());
        }
        let mut outs: Vec<StepOutput> = results.into_iter().map(|r| r.expect("checked")).collect();
        if self.parallel.dp_attention {
            return Ok(outs);
        }
        // Tensor parallel: every rank computed the same tokens from the same all-reduced sums.
        let tokens = |o: &StepOutput| o.seqs.iter().map(|s| s.sampled.as_ref().map(|t| t.token)).collect::<Vec<_>>();
        if let Some(r) = outs.iter().position(|o| tokens(o) != tokens(&outs[0])) {
            let why = format!("rank {r} sampled other tokens than rank 0 from the same all-reduced sums");
            self.broken = Some(why.clone());
            return Err(FatalBackendError(why).into());
        }
        outs.truncate(1);
        Ok(outs)
    }
}
