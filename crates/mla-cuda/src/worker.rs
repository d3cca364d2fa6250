//! The worker thread's side of the CUDA backend: everything it owns (device, model, decode
//! graphs), how it is created on that thread (`start_worker`, alone or as a rank of a group),
//! and how it runs a step (a graph replay when one fits, else eager), timing each.

use crate::collective::NcclConnector;
use crate::device::Device;
use crate::model::memory_plan::DEFAULT_KV_GOAL_TOKENS;
use crate::model::{CudaModel, DecodeGraphs, DeviceWeights, DpaStep, ModelOptions, RankLink};
use crate::ops::PAGE_SIZE;
use crate::options::{CudaOptions, WeightsFrom};
use anyhow::Context;
use mla_core::runtime::agreement::StepAgreement;
use mla_core::runtime::collective::{Collective, Tag, ThreadRank};
use mla_core::runtime::step_thread::StepRunner;
use mla_core::step::plan::{StepOutput, StepPlan};
use mla_core::{Checkpoint, ModelConfig, RankLayout, StepLimits};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Host-side timing of the backend's steps, shared with whoever wants to watch it (the engine
/// benchmark): how long the GPU sat idle between steps while the host worked.
#[derive(Debug, Default, Clone, Copy)]
pub struct StepClock {
    pub steps: u64,
    pub graph_steps: u64,
    /// Sum over steps of (this step's job start − the previous step's end): the engine thread's
    /// work between steps (delivering, scheduling) plus the hand-over to the worker thread.
    pub between_steps_s: f64,
    /// Sum over graph steps of (launch queued − job start): building and uploading metadata.
    pub graph_prep_s: f64,
    /// Sum over all steps of the job's duration on the worker thread.
    pub in_step_s: f64,
}

impl StepClock {
    /// What happened since `earlier`.
    pub fn since(&self, earlier: &StepClock) -> StepClock {
        StepClock {
            steps: self.steps - earlier.steps,
            graph_steps: self.graph_steps - earlier.graph_steps,
            between_steps_s: self.between_steps_s - earlier.between_steps_s,
            graph_prep_s: self.graph_prep_s - earlier.graph_prep_s,
            in_step_s: self.in_step_s - earlier.in_step_s,
        }
    }
}

/// What the worker owns. Field order is drop order: graphs (which may hold collectives) before
/// the model (which owns the communicator), device memory before the context.
pub struct DeviceWorker {
    pub graphs: DecodeGraphs,
    pub model: CudaModel,
    pub dev: Device,
    clock: Arc<Mutex<StepClock>>,
    last_end: Option<Instant>,
    /// The clock when it was last logged.
    logged: StepClock,
}

const CLOCK_LOG_EVERY: u64 = 2000;

impl DeviceWorker {
    /// The step clock this worker keeps (see `StepClock`).
    pub fn clock(&self) -> Arc<Mutex<StepClock>> {
        self.clock.clone()
    }

    /// "cuda:0 (NVIDIA H200, sm_90)", for logs and `Backend::device_name`.
    pub fn describe(&self, ordinal: usize) -> String {
        let info = &self.dev.gpu.info;
        let jit = if self.dev.jit() { ", PTX JIT" } else { "" };
        format!("cuda:{ordinal} ({}, sm_{}{}{jit})", info.name, info.compute_capability.0, info.compute_capability.1)
    }

    /// One engine step: a captured graph when one fits, else eager.
    pub fn step(&mut self, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        if plan.has_speculative() {
            return self.timed(|w| Ok((w.model.step_speculative(&w.dev, Some(&mut w.graphs), plan, None)?, None)));
        }
        self.timed(|w| match w.model.step_with_graphs(&w.dev, &mut w.graphs, plan) {
            Some(r) => r.map(|(out, t)| (out, Some(t.launched))),
            None => Ok((w.model.step(&w.dev, plan)?, None)),
        })
    }

    /// A step of a DP-attention rank, run as the group agreed (`mla_core::runtime::agreement`).
    /// `mtp_passes`: every rank's rows in each MTP pass of the step (empty without speculative
    /// decoding); when there are any, every rank runs them, eagerly, whatever its own plan.
    pub fn step_agreed(
        &mut self,
        plan: &StepPlan,
        agreed: &StepAgreement,
        mtp_passes: &[Vec<usize>],
    ) -> anyhow::Result<StepOutput> {
        if !mtp_passes.is_empty() {
            let StepAgreement::Eager { counts } = agreed else {
                anyhow::bail!("a speculative step of DP-attention ranks runs eagerly; the group agreed {agreed:?}")
            };
            let dpa = DpaStep { counts, passes: mtp_passes };
            return self.timed(|w| Ok((w.model.step_speculative(&w.dev, None, plan, Some(dpa))?, None)));
        }
        self.timed(|w| match agreed {
            StepAgreement::Graph { batch } => {
                let (out, t) = w.model.replay_batch(&w.dev, &mut w.graphs, plan, *batch)?;
                Ok((out, Some(t.launched)))
            }
            StepAgreement::Eager { counts } => Ok((w.model.step_rank(&w.dev, plan, counts)?, None)),
        })
    }

    /// Runs `f` (a step: its output and when a graph launch was queued) and keeps the clock.
    fn timed(
        &mut self,
        f: impl FnOnce(&mut Self) -> anyhow::Result<(StepOutput, Option<Instant>)>,
    ) -> anyhow::Result<StepOutput> {
        let start = Instant::now();
        let (out, launched) = f(self)?;
        let end = Instant::now();
        let mut c = self.clock.lock().expect("the step clock is never poisoned");
        c.steps += 1;
        if let Some(prev) = self.last_end {
            c.between_steps_s += (start - prev).as_secs_f64();
        }
        if let Some(l) = launched {
            c.graph_steps += 1;
            c.graph_prep_s += (l - start).as_secs_f64();
        }
        c.in_step_s += (end - start).as_secs_f64();
        self.last_end = Some(end);
        if c.steps.is_multiple_of(CLOCK_LOG_EVERY) {
            // Serving telemetry: how much of each step the GPU waited for the host.
            let w = c.since(&self.logged);
            tracing::info!(
                "last {} steps: {:.3} ms in the backend per step, {:.1} us host time between steps, {:.1} us graph metadata prep, {} of them graph replays",
                w.steps,
                w.in_step_s / w.steps as f64 * 1e3,
                w.between_steps_s / w.steps as f64 * 1e6,
                if w.graph_steps > 0 { w.graph_prep_s / w.graph_steps as f64 * 1e6 } else { 0.0 },
                w.graph_steps
            );
            self.logged = *c;
        }
        Ok(out)
    }
}

impl StepRunner for DeviceWorker {
    type Step = Vec<StepPlan>;
    type Output = Vec<StepOutput>;

    fn run_step(&mut self, plans: &Vec<StepPlan>) -> anyhow::Result<Vec<StepOutput>> {
        anyhow::ensure!(plans.len() == 1, "one GPU is one attention rank; the step has {} plans", plans.len());
        self.model.step_limits.check(plans)?;
        Ok(vec![self.step(&plans[0])?])
    }
}

/// How a worker joins a group of ranks (tensor parallel or DP attention).
pub struct RankJoin {
    pub layout: RankLayout,
    /// Connects this rank's device collective, on the worker thread once its device is current.
    pub connector: Arc<NcclConnector>,
    /// The host-side link to the other ranks' threads of this process (a barrier before NCCL).
    pub host: ThreadRank,
}

/// Creates everything a worker owns, on the worker thread: device (and communicator), weights
/// (this rank's share), workspace, KV cache and decode graphs.
pub fn start_worker(
    cfg: ModelConfig,
    weights: WeightsFrom,
    opts: &CudaOptions,
    join: Option<RankJoin>,
) -> anyhow::Result<DeviceWorker> {
    let dev = Device::new(opts.device)?;
    let (layout, link) = match join {
        None => (RankLayout::SINGLE, RankLink::Single),
        Some(mut j) => {
            let (rank, world) = (j.layout.rank, j.layout.world);
            // NCCL's setup waits for every rank without a timeout: meet this process's other
            // ranks on the host first, so a rank whose device failed to open stops them here
            // instead (ranks on other nodes are covered by node 0's start-up wait). The host
            // group is this node's ranks only, not the whole `world`.
            let here = j.host.world();
            j.host.all_gather(Tag::new("device ready", 0), &[1.0], &vec![1; here])?;
            let comm =
                j.connector.connect(rank, world).with_context(|| format!("connecting rank {rank} of {world}"))?;
            let link = RankLink::joined(&dev, comm, j.layout.dp_attention)
                .with_context(|| format!("first collectives of rank {rank} of {world}"))?;
            (j.layout, link)
        }
    };
    let local = layout.local_config(&cfg);
    let t0 = std::time::Instant::now();
    let mtp = opts.mtp_drafts > 0;
    let (w, source) = match weights {
        WeightsFrom::Checkpoint(dir) => {
            let ckpt = Checkpoint::open(&dir, &cfg)?;
            (DeviceWeights::load_rank_with(&cfg, &ckpt, layout, &dev, mtp)?, format!("checkpoint {}", dir.display()))
        }
        WeightsFrom::DummyOnDevice { seed } => (
            DeviceWeights::dummy_with(&local, &dev, seed, mtp)?,
            format!("dummy weights drawn on the device (seed {seed})"),
        ),
        WeightsFrom::Host(src) => {
            (DeviceWeights::load_rank_with(&cfg, src.as_ref(), layout, &dev, mtp)?, src.describe())
        }
    };
    dev.gpu.sync()?;
    let max_model_len = opts.max_model_len.unwrap_or(cfg.max_position_embeddings);
    // The FFN of a DP-attention rank runs over every rank's rows. The server logs the notes.
    let gathered = if layout.dp_attention { layout.world } else { 1 };
    let (step_limits, _notes) = StepLimits::derive(opts.budget(), gathered)?;
    let mopts = ModelOptions {
        step_limits,
        fit: opts.budget_fit,
        kv_goal_tokens: opts.max_model_len.unwrap_or(cfg.max_position_embeddings.min(DEFAULT_KV_GOAL_TOKENS)),
        max_kv_chunk: opts.max_num_batched_tokens.max(16384),
        gpu_memory_utilization: opts.gpu_memory_utilization,
        num_blocks: opts.num_blocks,
        max_model_len,
        small_batch_gemv: opts.small_batch_gemv,
        fp8_w8a8: opts.fp8_w8a8,
        kv_cache_dtype: opts.kv_cache_dtype,
        mtp_drafts: opts.mtp_drafts,
    };
    let weight_bytes = w.bytes();
    let fp8 = w.fp8_share();
    let model = CudaModel::new_rank(&dev, local, w, &mopts, link)?;
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let who = if layout.world > 1 {
        format!("rank {} of {} on cuda:{}", layout.rank, layout.world, opts.device)
    } else {
        format!("cuda:{}", opts.device)
    };
    if fp8.matrices > 0 {
        tracing::info!(
            "{who}: {} weight matrices in block FP8 ({:.2} GiB of the {:.2} GiB of weights, scales included)",
            fp8.matrices,
            gib(fp8.bytes),
            gib(weight_bytes)
        );
    }
    tracing::info!(
        "{who} ({}): weights {:.2} GiB from {source} in {:.1}s; activations {:.2} GiB (measured); KV cache {:.2} GiB = {} blocks of {PAGE_SIZE} = {} tokens of {} ({} bytes per token)",
        dev.gpu.info.name,
        gib(weight_bytes),
        t0.elapsed().as_secs_f64(),
        gib(model.activation_bytes),
        gib(model.cache_bytes()),
        model.num_blocks,
        model.num_blocks * PAGE_SIZE,
        match model.cache_dtype {
            mla_core::KvCacheDtype::Auto => "bf16",
            mla_core::KvCacheDtype::Fp8E4m3 => "fp8_e4m3",
        },
        model.cache_bytes_per_token()
    );
    let mut model = model;
    let t1 = std::time::Instant::now();
    // The memory planner may have cut the batch below --max-num-seqs: graphs up to what remains.
    // Speculative decoding's verify steps run 1 + drafts rows per sequence.
    let batches = graph_sizes_within(opts.graph_sizes(), model.step_limits.rank_seqs);
    let sizes = match mtp {
        true => graph_sizes_within(speculative_graph_sizes(&batches, opts.mtp_drafts), model.lim.max_seqs),
        false => batches.clone(),
    };
    let mut graphs = model.capture_decode_buckets(&dev, &sizes, opts.cuda_graph_memory_budget)?;
    if !sizes.is_empty() {
        tracing::info!(
            "CUDA graphs for decode batch sizes {:?} captured in {:.2}s ({:.1} MiB); larger batches run eagerly",
            graphs.batch_sizes(),
            t1.elapsed().as_secs_f64(),
            graphs.bytes as f64 / (1u64 << 20) as f64
        );
    }
    if mtp && !graphs.is_empty() {
        let t2 = std::time::Instant::now();
        let budget = opts.cuda_graph_memory_budget.saturating_sub(graphs.bytes);
        graphs.mtp = model.capture_mtp_passes(&dev, &batches, &[opts.mtp_drafts], budget)?;
        let (first, chain) = graphs.mtp.shapes();
        if !first.is_empty() {
            tracing::info!(
                "CUDA graphs for the MTP passes after decode batches of {:?} sequences{} captured in {:.2}s ({:.1} MiB)",
                first.iter().map(|&(b, _)| b).collect::<Vec<_>>(),
                if chain.is_empty() { String::new() } else { " and the chained passes".to_string() },
                t2.elapsed().as_secs_f64(),
                graphs.mtp.bytes as f64 / (1u64 << 20) as f64
            );
        }
    }
    Ok(DeviceWorker { graphs, model, dev, clock: Arc::default(), last_end: None, logged: StepClock::default() })
}

/// With speculative decoding a verify step of `b` sequences runs up to `b * (1 + drafts)` rows:
/// each size, and each times that.
fn speculative_graph_sizes(sizes: &[usize], drafts: usize) -> Vec<usize> {
    let mut v: Vec<usize> = sizes.iter().flat_map(|&b| [b, b * (1 + drafts)]).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// `sizes` (ascending) without those above `max`, and `max` itself when some were dropped, so
/// that every admissible batch still has a graph.
fn graph_sizes_within(mut sizes: Vec<usize>, max: usize) -> Vec<usize> {
    let before = sizes.len();
    sizes.retain(|&b| b <= max);
    if sizes.len() < before {
        sizes.push(max);
    }
    sizes
}

#[cfg(test)]
mod tests {
    #[test]
    fn graphs_stop_at_the_planned_batch() {
        use super::graph_sizes_within;
        assert_eq!(graph_sizes_within(vec![1, 8, 64, 256, 512], 300), vec![1, 8, 64, 256, 300]);
        assert_eq!(graph_sizes_within(vec![1, 8, 64], 64), vec![1, 8, 64]);
        assert_eq!(graph_sizes_within(vec![], 64), Vec::<usize>::new());
    }
}
