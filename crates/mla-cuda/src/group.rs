//! One copy of the model over several GPUs, a worker thread per GPU (its rank), as tensor
//! parallelism or DP attention (see `RankMode`), stepped by `mla_core::runtime::group`:
//! - tensor parallel: every rank runs the engine's one plan; all of them compute the same tokens;
//! - DP attention: rank r runs plan r; before any rank starts, the group agrees on graph or eager
//!   and on the rows per rank (`mla_core::runtime::agreement`), and an idle rank still runs every FFN
//!   collective.
//!
//! The ranks talk to each other only through their NCCL communicator (`gpu::nccl::NcclComm`). A
//! rank that fails has its peers' communicators aborted (`NcclComm::aborter`) by the group.

use crate::collective::{Aborter, NcclConnector};
use crate::model::graph_expressible;
use crate::ops::PAGE_SIZE;
use crate::options::{CudaOptions, WeightsFrom};
use crate::worker::{start_worker, DeviceWorker, RankJoin};
use mla_core::runtime::collective::ThreadGroup;
use mla_core::runtime::group::{GroupBackend, GroupParts, NodeReady, NodeStep, RemoteNode};
use mla_core::runtime::step_thread::{StepRunner, StepThread};
use mla_core::step::plan::StepOutput;
use mla_core::{CacheLayout, ModelConfig, RankLayout, StepLimits};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// How long the host-side barrier at startup waits for the slowest rank of this process.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(1800);

pub type CudaGroupBackend = GroupBackend<CudaRankWorker>;

/// The layout of a group and how it behaves.
#[derive(Clone)]
pub struct GroupOptions {
    /// Ranks in the whole group (on every node).
    pub world: usize,
    /// DP attention instead of tensor parallelism.
    pub dp_attention: bool,
    /// A step that takes longer than this stops the group.
    pub watchdog: Duration,
    pub connector: Arc<NcclConnector>,
}

/// One rank: its worker (device, model, graphs).
pub struct CudaRankWorker {
    worker: DeviceWorker,
    rank: usize,
    steps: u64,
}

impl StepRunner for CudaRankWorker {
    type Step = NodeStep;
    type Output = StepOutput;

    fn run_step(&mut self, step: &NodeStep) -> anyhow::Result<StepOutput> {
        self.steps += 1;
        mla_core::runtime::fault::maybe_kill(self.rank, self.steps);
        let plan = step.plan_of(self.rank);
        match &step.agreed {
            None => self.worker.step(plan),
            Some(a) => self.worker.step_agreed(plan, a, &mla_core::speculative::mtp_pass_counts(&step.plans)),
        }
    }
}

/// The ranks of this process, started, and what the group needs to know about them.
pub struct LocalRanks {
    pub threads: Vec<StepThread<CudaRankWorker>>,
    pub aborters: Vec<Aborter>,
    pub ready: NodeReady,
}

/// What a rank reports once it is ready.
struct Ready {
    name: String,
    num_blocks: usize,
    graph_batches: Vec<usize>,
    step_limits: StepLimits,
    aborter: Aborter,
}

/// Starts global ranks `ranks` of a group of `group.world`, rank `ranks.start + i` on GPU
/// `opts.device + i`, all at once (their communicators' setup waits for every rank of the group,
/// on every node), and returns when all are ready or the first has failed.
pub fn start_ranks(
    cfg: &ModelConfig,
    weights: &WeightsFrom,
    opts: &CudaOptions,
    group: &GroupOptions,
    ranks: Range<usize>,
) -> anyhow::Result<LocalRanks> {
    let world = group.world;
    crate::model::check_supported(cfg)?;
    for r in 0..world {
        let layout = RankLayout { rank: r, world, dp_attention: group.dp_attention };
        crate::model::check_supported(&layout.local_config(cfg))
            .map_err(|e| anyhow::anyhow!("rank {r} of {world}: {e}"))?;
    }
    let first = ranks.start;
    let inits: Vec<_> = ThreadGroup::ranks(ranks.len(), STARTUP_TIMEOUT)
        .into_iter()
        .zip(ranks)
        .map(|(host, r)| {
            let (cfg, weights, connector) = (cfg.clone(), weights.clone(), group.connector.clone());
            let opts = CudaOptions { device: opts.device + r - first, ..opts.clone() };
            let layout = RankLayout { rank: r, world, dp_attention: group.dp_attention };
            let init = move || {
                let join = RankJoin { layout, connector, host };
                let worker = start_worker(cfg, weights, &opts, Some(join))?;
                let comm = worker.model.mode.comm().expect("a rank of a group has a collective");
                let ready = Ready {
                    name: worker.describe(opts.device),
                    num_blocks: worker.model.num_blocks,
                    graph_batches: worker.graphs.batch_sizes(),
                    step_limits: worker.model.step_limits,
                    aborter: comm.aborter(),
                };
                Ok((CudaRankWorker { worker, rank: r, steps: 0 }, ready))
            };
            (format!("cuda-rank-{r}"), init)
        })
        .collect();
    let started = StepThread::spawn_group(inits)?;
    // The ranks agreed on the cache size and captured the same graphs; check, since a mismatch
    // would hang the first step that relies on it.
    let (num_blocks, graph_batches) = (started[0].1.num_blocks, started[0].1.graph_batches.clone());
    let step_limits = started[0].1.step_limits;
    for (i, (_, x)) in started.iter().enumerate() {
        anyhow::ensure!(
            x.num_blocks == num_blocks && x.graph_batches == graph_batches && x.step_limits == step_limits,
            "rank {} disagrees with rank {first} on the KV cache ({} blocks, not {num_blocks}), the decode graphs ({:?}, not {graph_batches:?}) or the step limits ({:?}, not {step_limits:?})",
            first + i,
            x.num_blocks,
            x.graph_batches,
            x.step_limits
        );
    }
    let ready = NodeReady {
        ranks: started.len(),
        cache: CacheLayout { block_size: PAGE_SIZE, num_blocks },
        graph_batches,
        step_limits,
        describe: started.iter().map(|(_, r)| r.name.as_str()).collect::<Vec<_>>().join(", "),
    };
    let aborters = started.iter().map(|(_, r)| r.aborter.clone()).collect();
    Ok(LocalRanks { threads: started.into_iter().map(|(t, _)| t).collect(), aborters, ready })
}

/// A whole group in this process.
pub fn local_group(
    cfg: ModelConfig,
    weights: WeightsFrom,
    opts: CudaOptions,
    group: GroupOptions,
) -> anyhow::Result<CudaGroupBackend> {
    let local = start_ranks(&cfg, &weights, &opts, &group, 0..group.world)?;
    Ok(GroupBackend::new(group_parts(cfg, &opts, &group, local, vec![])))
}

/// The `GroupParts` of this process's ranks (ranks `0 ..`, node 0) and the other nodes', each
/// ready (`RemoteNode::wait_ready`) with what it reported.
pub fn group_parts(
    cfg: ModelConfig,
    opts: &CudaOptions,
    group: &GroupOptions,
    local: LocalRanks,
    remotes: Vec<(RemoteNode, NodeReady)>,
) -> GroupParts<CudaRankWorker> {
    let mode = if group.dp_attention { "DP attention" } else { "tensor parallel" };
    let mut devices = local.ready.describe.clone();
    for (r, ready) in &remotes {
        devices += &format!("; node {}: {}", r.node(), ready.describe);
    }
    let max_model_len = opts.max_model_len.unwrap_or(cfg.max_position_embeddings).min(cfg.max_position_embeddings);
    GroupParts {
        name: format!("{} GPUs, {mode}: {devices}", group.world),
        max_model_len,
        cfg,
        dp_attention: group.dp_attention,
        local: local.threads,
        aborters: local.aborters,
        remotes: remotes.into_iter().map(|(r, ready)| (r, ready.ranks)).collect(),
        cache: local.ready.cache,
        step_limits: local.ready.step_limits,
        graph_batches: local.ready.graph_batches,
        graphable: graph_expressible,
        watchdog: group.watchdog,
        // Every rank runs the verdict on the device: over its own sequences under DP attention,
        // over the group's (all-reduced, identical) logits under tensor parallelism. The
        // lossless check passes on two ranks of either layout (run S28).
        sampled_drafts: true,
        // Every rank copies the forked block in its own cache (`CudaModel::queue_forks`).
        forks_blocks: true,
        // The device verdict shapes each target row as the sampler does (kernels/speculative.cu).
        shaped_drafts: true,
    }
}
