//! `CudaBackend`: the `mla_core::Backend` the engine drives. One worker thread owns the CUDA
//! context, the stream, cuBLAS, the weights, the activation workspace and the KV cache; the
//! backend handle only passes it work over a channel and waits for the answer, so nothing
//! device-related ever crosses threads.

use crate::device::Device;
use crate::model::{CudaModel, DeviceWeights, Limits, ModelOptions};
use crate::ops::PAGE_SIZE;
use anyhow::Context;
use mla_core::plan::{StepOutput, StepPlan};
use mla_core::{Backend, CacheLayout, Checkpoint, ModelConfig, WeightSource};
use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::JoinHandle;

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
}

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
        }
    }
}

/// What the worker owns. Field order is drop order: device memory before the context.
pub struct Worker {
    pub model: CudaModel,
    pub dev: Device,
}

type Job = Box<dyn FnOnce(&mut Worker) + Send>;

pub struct CudaBackend {
    cfg: ModelConfig,
    layout: CacheLayout,
    name: String,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// What the worker reports once it is ready.
struct Ready {
    name: String,
    num_blocks: usize,
}

impl CudaBackend {
    pub fn new(cfg: ModelConfig, weights: WeightsFrom, opts: CudaOptions) -> anyhow::Result<Self> {
        crate::model::check_supported(&cfg)?;
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<anyhow::Result<Ready>>();
        let wcfg = cfg.clone();
        let thread = std::thread::Builder::new()
            .name(format!("cuda-worker-{}", opts.device))
            .spawn(move || {
                let mut worker = match start_worker(wcfg, weights, &opts) {
                    Ok(w) => w,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
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
                };
                if ready_tx.send(Ok(ready)).is_err() {
                    return;
                }
                while let Ok(job) = jobs_rx.recv() {
                    job(&mut worker);
                }
            })
            .context("spawning the CUDA worker thread")?;
        let ready = ready_rx.recv().map_err(|_| anyhow::anyhow!("the CUDA worker thread died while starting"))??;
        Ok(CudaBackend {
            cfg,
            layout: CacheLayout { block_size: PAGE_SIZE, num_blocks: ready.num_blocks },
            name: ready.name,
            jobs: Some(jobs_tx),
            thread: Some(thread),
        })
    }

    /// Runs `f` on the worker thread with the device and model (tests, benchmarks, graphs).
    pub fn with_worker<R, F>(&self, f: F) -> anyhow::Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut Worker) -> R + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |w| {
            let _ = tx.send(f(w));
        });
        self.jobs
            .as_ref()
            .expect("jobs channel lives as long as the backend")
            .send(job)
            .map_err(|_| anyhow::anyhow!("the CUDA worker thread has stopped"))?;
        rx.recv().map_err(|_| anyhow::anyhow!("the CUDA worker thread stopped during a job (it panicked)"))
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
        WeightsFrom::DummyOnDevice { seed } => (DeviceWeights::dummy(&cfg, &dev.k, dev.stream(), seed)?, format!("dummy weights drawn on the device (seed {seed})")),
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
    let mopts = ModelOptions { limits, gpu_memory_utilization: opts.gpu_memory_utilization, num_blocks: opts.num_blocks, max_model_len };
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
    Ok(Worker { model, dev })
}

impl Backend for CudaBackend {
    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn model_config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        self.layout
    }

    fn step(&mut self, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        let plan = plan.clone();
        self.with_worker(move |w| w.model.step(&w.dev, &plan))?
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Closing the channel ends the worker loop; it frees device memory on its own thread.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
