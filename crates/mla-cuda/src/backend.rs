//! `CudaBackend`: the `mla_core::Backend` the engine drives. One worker thread (mla-core's
//! `StepThread`) owns the CUDA context, the stream, cuBLAS, the weights, the activation workspace
//! and the KV cache; the backend handle only passes it work over a channel and collects the
//! answer, so nothing device-related ever crosses threads. Steps are started asynchronously
//! (`Backend::start_step`), so the engine's bookkeeping of one step overlaps the next.

use crate::device::Device;
use crate::model::{CudaModel, DecodeGraphs, DeviceWeights, Limits, ModelOptions};
use crate::ops::PAGE_SIZE;
use anyhow::Context;
use mla_core::plan::{StepOutput, StepPlan};
use mla_core::step_thread::{StepRunner, StepThread};
use mla_core::{Backend, CacheLayout, Checkpoint, ModelConfig, WeightSource};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Where the weights come from.
pub enum WeightsFrom {
    /// A HF model directory (bf16, or block-fp8 dequantized to bf16 while loading).
    Checkpoint(PathBuf),
    /// `--load-format dummy`: random values drawn on the device (fast, any size).
    DummyOnDevice { seed: u64 },
    /// Any host-side source, e.g. mla-core's `DummyWeights` to compare with the CPU backend.
    Host(Box<dyn WeightSource + Send>),
}

#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    pub gpu_memory_utilization: f64,
    /// Tokens per step (prefill chunk size).
    pub max_num_batched_tokens: usize,
    /// Sequences per step.
    pub max_num_seqs: usize,
    /// Longest sequence; defaults to the model's max_position_embeddings.
    pub max_model_len: Option<usize>,
    /// Rows of logits one step may return besides sampled rows (tests, scoring).
    pub max_extra_logit_rows: usize,
    /// Fixed KV cache size in blocks of 64 tokens, instead of sizing from memory.
    pub num_blocks: Option<usize>,
    /// Decode batch sizes captured as CUDA graphs at startup (empty: every step eager). Sizes
    /// above `max_num_seqs` are dropped.
    pub cuda_graph_batch_sizes: Vec<usize>,
    /// Device memory the graph captures may take; capturing stops at the first size that would
    /// exceed it (it must fit in the 512 MiB the KV sizing leaves free).
    pub cuda_graph_memory_budget: usize,
    /// Dense projections of single-row steps through the weight-streaming GEMV kernel instead of
    /// cuBLAS (`model::small_linear`; off for A/B runs).
    pub small_batch_gemv: bool,
}

/// The default decode graph buckets: fine steps at small batches, where padding costs most.
pub const DEFAULT_GRAPH_BATCH_SIZES: &[usize] =
    &[1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256];

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            gpu_memory_utilization: 0.9,
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
            max_model_len: None,
            max_extra_logit_rows: 512,
            num_blocks: None,
            cuda_graph_batch_sizes: DEFAULT_GRAPH_BATCH_SIZES.to_vec(),
            cuda_graph_memory_budget: 256 << 20,
            small_batch_gemv: true,
        }
    }
}

impl CudaOptions {
    /// The graph sizes this configuration captures: the asked ones up to `max_num_seqs`, plus
    /// `max_num_seqs` itself so that every admissible batch has a graph.
    pub fn graph_sizes(&self) -> Vec<usize> {
        if self.cuda_graph_batch_sizes.is_empty() {
            return vec![];
        }
        let mut v: Vec<usize> =
            self.cuda_graph_batch_sizes.iter().copied().filter(|&b| b >= 1 && b <= self.max_num_seqs).collect();
        v.push(self.max_num_seqs);
        v.sort_unstable();
        v.dedup();
        v
    }
}

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

/// What the worker owns. Field order is drop order: graphs and device memory before the context.
pub struct Worker {
    pub graphs: DecodeGraphs,
    pub model: CudaModel,
    pub dev: Device,
    clock: Arc<Mutex<StepClock>>,
    last_end: Option<Instant>,
    /// The clock when it was last logged.
    logged: StepClock,
}

const CLOCK_LOG_EVERY: u64 = 2000;

impl Worker {
    /// One engine step: a captured graph when one fits, else eager.
    fn step(&mut self, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        let start = Instant::now();
        let (out, launched) = match self.model.step_with_graphs(&self.dev, &mut self.graphs, plan) {
            Some(r) => {
                let (out, t) = r?;
                (out, Some(t.launched))
            }
            None => (self.model.step(&self.dev, plan)?, None),
        };
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

impl StepRunner for Worker {
    type Step = Vec<StepPlan>;
    type Output = Vec<StepOutput>;

    fn run_step(&mut self, plans: &Vec<StepPlan>) -> anyhow::Result<Vec<StepOutput>> {
        anyhow::ensure!(plans.len() == 1, "one GPU is one attention rank; the step has {} plans", plans.len());
        Ok(vec![self.step(&plans[0])?])
    }
}

pub struct CudaBackend {
    cfg: ModelConfig,
    layout: CacheLayout,
    name: String,
    /// Dropping it ends the worker thread, which frees device memory on its own thread.
    thread: StepThread<Worker>,
    clock: Arc<Mutex<StepClock>>,
    graph_sizes: Vec<usize>,
}

/// What the worker reports once it is ready.
struct Ready {
    name: String,
    num_blocks: usize,
    clock: Arc<Mutex<StepClock>>,
    graph_sizes: Vec<usize>,
}

impl CudaBackend {
    pub fn new(cfg: ModelConfig, weights: WeightsFrom, opts: CudaOptions) -> anyhow::Result<Self> {
        crate::model::check_supported(&cfg)?;
        let wcfg = cfg.clone();
        let (thread, ready) = StepThread::spawn(format!("cuda-worker-{}", opts.device), move || {
            let worker = start_worker(wcfg, weights, &opts)?;
            let ready = Ready {
                name: format!(
                    "cuda:{} ({}, sm_{}{}{})",
                    opts.device,
                    worker.dev.gpu.info.name,
                    worker.dev.gpu.info.compute_capability.0,
                    worker.dev.gpu.info.compute_capability.1,
                    if worker.dev.jit() { ", PTX JIT" } else { "" }
                ),
                num_blocks: worker.model.num_blocks,
                clock: worker.clock.clone(),
                graph_sizes: worker.graphs.batch_sizes(),
            };
            Ok((worker, ready))
        })
        .context("starting the CUDA worker thread")?;
        Ok(CudaBackend {
            cfg,
            layout: CacheLayout { block_size: PAGE_SIZE, num_blocks: ready.num_blocks },
            name: ready.name,
            thread,
            clock: ready.clock,
            graph_sizes: ready.graph_sizes,
        })
    }

    /// Decode batch sizes replayed from CUDA graphs.
    pub fn graph_batch_sizes(&self) -> &[usize] {
        &self.graph_sizes
    }

    /// The step clock's totals so far (see `StepClock`).
    pub fn step_clock(&self) -> Arc<Mutex<StepClock>> {
        self.clock.clone()
    }

    /// Runs `f` on the worker thread with the device and model (tests, benchmarks, graphs).
    pub fn with_worker<R, F>(&self, f: F) -> anyhow::Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut Worker) -> R + Send + 'static,
    {
        self.thread.with(f)
    }
}

fn start_worker(cfg: ModelConfig, weights: WeightsFrom, opts: &CudaOptions) -> anyhow::Result<Worker> {
    let dev = Device::new(opts.device)?;
    let t0 = std::time::Instant::now();
    let (w, source) = match weights {
        WeightsFrom::Checkpoint(dir) => {
            let ckpt = Checkpoint::open(&dir, &cfg)?;
            (DeviceWeights::load(&cfg, &ckpt)?, format!("checkpoint {}", dir.display()))
        }
        WeightsFrom::DummyOnDevice { seed } => (
            DeviceWeights::dummy(&cfg, &dev.k, dev.stream(), seed)?,
            format!("dummy weights drawn on the device (seed {seed})"),
        ),
        WeightsFrom::Host(src) => (DeviceWeights::load(&cfg, src.as_ref())?, src.describe()),
    };
    dev.gpu.sync()?;
    let max_model_len = opts.max_model_len.unwrap_or(cfg.max_position_embeddings);
    let limits = Limits {
        max_tokens: opts.max_num_batched_tokens,
        max_seqs: opts.max_num_seqs,
        max_logit_rows: opts.max_num_seqs + opts.max_extra_logit_rows,
        max_kv_chunk: opts.max_num_batched_tokens.max(16384),
    };
    let mopts = ModelOptions {
        limits,
        gpu_memory_utilization: opts.gpu_memory_utilization,
        num_blocks: opts.num_blocks,
        max_model_len,
        small_batch_gemv: opts.small_batch_gemv,
    };
    let weight_bytes = w.bytes();
    let model = CudaModel::new(&dev, cfg, w, &mopts)?;
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    tracing::info!(
        "{}: weights {:.2} GiB from {source} in {:.1}s; activations {:.2} GiB (measured); KV cache {:.2} GiB = {} blocks of {PAGE_SIZE} = {} tokens",
        dev.gpu.info.name,
        gib(weight_bytes),
        t0.elapsed().as_secs_f64(),
        gib(model.activation_bytes),
        gib(model.cache_bytes()),
        model.num_blocks,
        model.num_blocks * PAGE_SIZE
    );
    let mut model = model;
    let t1 = std::time::Instant::now();
    let sizes = opts.graph_sizes();
    let graphs = model.capture_decode_buckets(&dev, &sizes, opts.cuda_graph_memory_budget)?;
    if !sizes.is_empty() {
        tracing::info!(
            "CUDA graphs for decode batch sizes {:?} captured in {:.2}s ({:.1} MiB); larger batches run eagerly",
            graphs.batch_sizes(),
            t1.elapsed().as_secs_f64(),
            graphs.bytes as f64 / (1u64 << 20) as f64
        );
    }
    Ok(Worker { graphs, model, dev, clock: Arc::default(), last_end: None, logged: StepClock::default() })
}

impl Backend for CudaBackend {
    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn model_config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layouts(&self) -> Vec<CacheLayout> {
        vec![self.layout]
    }

    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        self.thread.start_step(plans);
    }

    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        self.thread.finish_step()
    }
}
