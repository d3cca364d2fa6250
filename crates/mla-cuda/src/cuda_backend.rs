//! `CudaBackend`: the `mla_core::Backend` the engine drives. One worker thread (mla-core's
//! `StepThread`) owns the CUDA context, the stream, cuBLAS, the weights, the activation workspace
//! and the KV cache; the backend handle only passes it work over a channel and collects the
//! answer, so nothing device-related ever crosses threads. Steps are started asynchronously
//! (`Backend::start_step`), so the engine's bookkeeping of one step overlaps the next.

use crate::ops::PAGE_SIZE;
use crate::options::{CudaOptions, WeightsFrom};
use crate::worker::{start_worker, DeviceWorker, StepClock};
use anyhow::Context;
use mla_core::runtime::step_thread::StepThread;
use mla_core::step::plan::{StepOutput, StepPlan};
use mla_core::{Backend, CacheLayout, ModelConfig, StepLimits};
use std::sync::{Arc, Mutex};

pub struct CudaBackend {
    cfg: ModelConfig,
    layout: CacheLayout,
    /// The largest step the worker was sized for (the memory planner's choice).
    step_limits: StepLimits,
    name: String,
    /// Dropping it ends the worker thread, which frees device memory on its own thread.
    thread: StepThread<DeviceWorker>,
    clock: Arc<Mutex<StepClock>>,
    graph_sizes: Vec<usize>,
}

/// What the worker reports once it is ready.
struct Ready {
    name: String,
    num_blocks: usize,
    step_limits: StepLimits,
    clock: Arc<Mutex<StepClock>>,
    graph_sizes: Vec<usize>,
}

impl CudaBackend {
    pub fn new(cfg: ModelConfig, weights: WeightsFrom, opts: CudaOptions) -> anyhow::Result<Self> {
        crate::model::check_supported(&cfg)?;
        let wcfg = cfg.clone();
        let (thread, ready) = StepThread::spawn(format!("cuda-worker-{}", opts.device), move || {
            let worker = start_worker(wcfg, weights, &opts, None)?;
            let ready = Ready {
                name: worker.describe(opts.device),
                num_blocks: worker.model.num_blocks,
                step_limits: worker.model.step_limits,
                clock: worker.clock(),
                graph_sizes: worker.graphs.batch_sizes(),
            };
            Ok((worker, ready))
        })
        .context("starting the CUDA worker thread")?;
        Ok(CudaBackend {
            cfg,
            layout: CacheLayout { block_size: PAGE_SIZE, num_blocks: ready.num_blocks },
            step_limits: ready.step_limits,
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
        F: FnOnce(&mut DeviceWorker) -> R + Send + 'static,
    {
        self.thread.with(f)
    }
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

    fn step_limits(&self) -> StepLimits {
        self.step_limits
    }

    /// Yes: the verdict on sampled drafts runs on the device before the sampler
    /// (kernels/speculative.cu), held to the same chi-square check as the CPU reference.
    fn verifies_sampled_drafts(&self) -> bool {
        true
    }

    /// Yes: the verdict shapes each target row by its bias and penalties (the drafts before it
    /// counted) as the sampler does, on the device.
    fn verifies_shaped_drafts(&self) -> bool {
        true
    }

    /// Yes: a fork's block is copied on the device, in stream order before the step
    /// (`CudaModel::queue_forks`).
    fn forks_blocks(&self) -> bool {
        true
    }

    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        self.thread.start_step(plans);
    }

    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        self.thread.finish_step()
    }
}
