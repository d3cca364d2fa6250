//! `mla-bench profile`: eager decode steps (one per batch size) and one eager prefill step of a
//! dummy-weight model, bracketed by cuProfilerStart/Stop, for a per-kernel time breakdown under
//! `ncu --profile-from-start off --metrics gpu__time_duration.sum` (summed by
//! `scripts/ncu_breakdown.py`, whose step names follow this order: the decode steps in the order
//! given, then the prefill). The decode steps read a cache of random latents, so no prefill of
//! the whole batch is needed.

use crate::dummy_model;
use mla_core::step::plan::{LogitsRequest, SeqStep, StepKind, StepPlan};
use mla_core::ModelConfig;
use mla_cuda::model::ModelOptions;
use mla_cuda::ops::PAGE_SIZE;
use mla_cuda::Device;

/// Steps each shape runs before the timed and the profiled one, so that neither sees cold caches
/// or first-launch costs.
const WARMUP_STEPS: usize = 3;

#[derive(Clone, Copy)]
enum Step {
    /// A decode step of this many sequences.
    Decode(usize),
    Prefill,
}

/// `batches`: one decode step for each, at `context`; `prefill_len` 0 leaves the prefill out.
pub fn run(cfg: ModelConfig, batches: &[usize], context: usize, prefill_len: usize) -> anyhow::Result<()> {
    let max_batch = batches.iter().copied().max().unwrap_or(0);
    anyhow::ensure!(max_batch > 0, "--batch: at least one batch size of 1 or more");
    let dev = Device::new(0)?;
    let pages = (context + 1).div_ceil(PAGE_SIZE);
    let opts = ModelOptions {
        num_blocks: Some(max_batch * pages + prefill_len.div_ceil(PAGE_SIZE)),
        max_model_len: context.max(prefill_len) + PAGE_SIZE,
        ..ModelOptions::fixed(prefill_len.max(max_batch), max_batch, max_batch, prefill_len.max(16384))
    };
    let mut model = dummy_model::build(&dev, &cfg, &opts)?;
    let vocab = cfg.vocab_size;
    // The prompt goes into the blocks after every decode sequence's.
    let base = (max_batch * pages) as u32;
    let prefill = |j: usize| StepPlan {
        kind: StepKind::Prefill,
        seqs: vec![SeqStep {
            fork: None,
            seq_id: 0,
            tokens: (0..prefill_len).map(|t| ((31 * t + j) % vocab) as u32).collect(),
            context_len: 0,
            block_table: (base..base + prefill_len.div_ceil(PAGE_SIZE) as u32).collect(),
            logits: LogitsRequest::None,
            sample: Some(dummy_model::greedy(0)),
            mtp: None,
        }],
    };
    let mut steps: Vec<Step> = batches.iter().map(|&b| Step::Decode(b)).collect();
    if prefill_len > 0 {
        steps.push(Step::Prefill);
    }
    let plan = |step: Step, j: usize| match step {
        Step::Decode(batch) => dummy_model::decode_plan(batch, context, pages, j, vocab),
        Step::Prefill => prefill(j),
    };
    for j in 0..WARMUP_STEPS {
        for &step in &steps {
            model.step(&dev, &plan(step, j))?;
        }
    }
    for &step in &steps {
        let t = std::time::Instant::now();
        model.step(&dev, &plan(step, WARMUP_STEPS))?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        match step {
            Step::Decode(batch) => eprintln!("eager decode step B={batch} ctx={context}: {ms:.2} ms"),
            Step::Prefill => eprintln!("eager prefill of {prefill_len} tokens: {ms:.2} ms"),
        }
    }
    profiler(true);
    for &step in &steps {
        model.step(&dev, &plan(step, WARMUP_STEPS + 1))?;
    }
    profiler(false);
    Ok(())
}

/// Starts or stops the profiler's collection (`ncu --profile-from-start off` records only in
/// between); without a profiler attached both are no-ops.
fn profiler(on: bool) {
    use cudarc::driver::sys::{cuProfilerStart, cuProfilerStop};
    // SAFETY: both calls take no arguments and only toggle profiling of the current context,
    // which `Device::new` made current on this thread.
    let r = unsafe {
        if on {
            cuProfilerStart()
        } else {
            cuProfilerStop()
        }
    };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        tracing::warn!("cuProfiler{}: {r:?}", if on { "Start" } else { "Stop" });
    }
}
