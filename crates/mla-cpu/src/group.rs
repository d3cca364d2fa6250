//! The CPU reference for the multi-GPU backends: `world` ranks, each a thread with its part of the
//! model, its own latent cache and a `Collective`, run every step together exactly as the GPU
//! ranks do with NCCL (`mla_core::runtime::group` does the stepping):
//! - tensor parallelism: every rank runs the engine's one plan with its share of the heads and
//!   FFN widths; the ranks all-reduce partial sums, so all of them compute the same tokens;
//! - DP attention: rank r runs plan r, for its own requests and cache; an empty plan is an idle
//!   rank, which still makes every collective of the step.
//!
//! On one node the ranks meet in a `ThreadGroup`; across nodes, through a TCP hub on node 0
//! (`mla_core::runtime::cluster::tcp_collective`). It is the correctness reference (`--device cpu`
//! accepts `--tp` and `--enable-dp-attention` for this), not a fast path.

use crate::model::Peers;
use crate::rank::CpuRank;
use mla_core::runtime::collective::{Collective, ThreadGroup};
use mla_core::runtime::group::{GroupBackend, GroupParts, NodeStep};
use mla_core::runtime::step_thread::{StepRunner, StepThread};
use mla_core::step::plan::StepOutput;
use mla_core::{CacheLayout, KvCacheDtype, ModelConfig, Parallel, StepLimits, WeightSource};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

pub type CpuGroupBackend = GroupBackend<CpuRankWorker>;

/// One rank: its share of the model, its cache and its link to the others.
pub struct CpuRankWorker {
    rank: CpuRank,
    comm: Box<dyn Collective + Send>,
    index: usize,
    dp_attention: bool,
    steps: u64,
}

impl StepRunner for CpuRankWorker {
    type Step = NodeStep;
    type Output = StepOutput;

    fn run_step(&mut self, step: &NodeStep) -> anyhow::Result<StepOutput> {
        self.steps += 1;
        mla_core::runtime::fault::maybe_kill(self.index, self.steps);
        let plan = step.plan_of(self.index);
        let counts = if self.dp_attention { step.counts() } else { vec![] };
        let passes = mla_core::speculative::mtp_pass_counts(&step.plans);
        self.rank.run(plan, Peers { comm: self.comm.as_mut(), counts: &counts }, &passes)
    }
}

/// Starts ranks `ranks` of `parallel` (one copy of the model, checked with `Parallel::check`),
/// rank `ranks.start + i` on `comms[i]`, each with a cache of `cache` holding `kv_dtype`, and
/// with the MTP layer when `mtp` (speculative decoding). All start at once.
#[allow(clippy::too_many_arguments)]
pub fn start_ranks(
    cfg: &ModelConfig,
    weights: Arc<dyn WeightSource + Send + Sync>,
    parallel: Parallel,
    ranks: Range<usize>,
    comms: Vec<Box<dyn Collective + Send>>,
    cache: CacheLayout,
    kv_dtype: KvCacheDtype,
    mtp: bool,
) -> anyhow::Result<Vec<StepThread<CpuRankWorker>>> {
    parallel.check(cfg)?;
    anyhow::ensure!(parallel.replicas == 1, "a rank group is one copy of the model; replicas are separate backends");
    anyhow::ensure!(comms.len() == ranks.len(), "{} collectives for ranks {ranks:?}", comms.len());
    tracing::info!(
        source = %weights.describe(),
        ranks = ?ranks,
        world = parallel.ranks(),
        dp_attention = parallel.dp_attention,
        block_size = cache.block_size,
        num_blocks = cache.num_blocks,
        kv_cache_dtype = kv_dtype.name(),
        "loading cpu ranks"
    );
    let inits: Vec<_> = ranks
        .zip(comms)
        .map(|(r, comm)| {
            let (cfg, weights) = (cfg.clone(), weights.clone());
            let layout = parallel.rank(r);
            let init = move || {
                let mut rank =
                    CpuRank::new(cfg, weights.as_ref(), layout, cache.block_size, cache.num_blocks, kv_dtype)?;
                if mtp {
                    rank.enable_mtp(weights.as_ref(), layout)?;
                }
                let worker = CpuRankWorker { rank, comm, index: r, dp_attention: layout.dp_attention, steps: 0 };
                Ok((worker, ()))
            };
            (format!("cpu-rank-{r}"), init)
        })
        .collect();
    Ok(StepThread::spawn_group(inits)?.into_iter().map(|(t, ())| t).collect())
}

/// Every rank of `parallel` in this process, meeting in a `ThreadGroup`; a rank that waits longer
/// than `timeout` in one collective (a rank stuck or gone) fails the group, and so does a step
/// that takes longer (CPU ranks of a DP-attention step may differ by a prefill chunk of work, so
/// it should be generous). Steps outside `step_limits` are refused before any rank starts. `mtp`:
/// every rank loads the MTP layer (speculative decoding, tensor parallel only).
#[allow(clippy::too_many_arguments)]
pub fn local_group(
    cfg: ModelConfig,
    weights: Arc<dyn WeightSource + Send + Sync>,
    parallel: Parallel,
    cache: CacheLayout,
    kv_dtype: KvCacheDtype,
    step_limits: StepLimits,
    timeout: Duration,
    mtp: bool,
) -> anyhow::Result<CpuGroupBackend> {
    let world = parallel.ranks();
    let comms =
        ThreadGroup::ranks(world, timeout).into_iter().map(|c| Box::new(c) as Box<dyn Collective + Send>).collect();
    let local = start_ranks(&cfg, weights, parallel, 0..world, comms, cache, kv_dtype, mtp)?;
    Ok(GroupBackend::new(group_parts(cfg, parallel, local, vec![], cache, step_limits, timeout)))
}

/// The `GroupParts` of CPU ranks: `local` are ranks `0 ..`, `remotes` the other nodes' with how
/// many ranks each holds.
pub fn group_parts(
    cfg: ModelConfig,
    parallel: Parallel,
    local: Vec<StepThread<CpuRankWorker>>,
    remotes: Vec<(mla_core::runtime::group::RemoteNode, usize)>,
    cache: CacheLayout,
    step_limits: StepLimits,
    watchdog: Duration,
) -> GroupParts<CpuRankWorker> {
    let mode = if parallel.dp_attention { "DP attention" } else { "tensor parallel" };
    let nodes = if remotes.is_empty() { String::new() } else { format!(" on {} nodes", remotes.len() + 1) };
    GroupParts {
        name: format!("cpu ({} ranks, {mode}{nodes}, {} threads)", parallel.ranks(), rayon::current_num_threads()),
        max_model_len: cfg.max_position_embeddings,
        cfg,
        dp_attention: parallel.dp_attention,
        local,
        // A CPU rank's collective fails on its own when a peer leaves: nothing to abort.
        aborters: vec![],
        remotes,
        cache,
        step_limits,
        graph_batches: vec![],
        graphable: |_| false,
        watchdog,
        sampled_drafts: true,
        forks_blocks: true,
        shaped_drafts: true,
    }
}
