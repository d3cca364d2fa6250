//! One eager decode step and one eager prefill step of a dummy-weight model, bracketed by
//! cuProfilerStart/Stop, for a per-kernel time breakdown under
//! `ncu --profile-from-start off --metrics gpu__time_duration.sum`. The decode step reads a
//! cache of random latents (standing in for `context` prefilled tokens per sequence), so no
//! prefill of the whole batch is needed.

use mla_core::plan::{LogitsRequest, SampleRequest, SeqStep, StepKind, StepPlan};
use mla_core::{ModelConfig, SamplingParams};
use mla_cuda::model::{CudaModel, DeviceWeights, Limits, ModelOptions};
use mla_cuda::ops::{Normal, PAGE_SIZE};
use mla_cuda::Device;
use std::path::Path;

fn greedy() -> Option<SampleRequest> {
    Some(SampleRequest { params: SamplingParams::greedy(), seed: 0, top_logprobs: None, penalty: None })
}

pub fn run(config: &Path, batch: usize, context: usize, prefill_len: usize) -> anyhow::Result<()> {
    let cfg = ModelConfig::from_file(config)?;
    let dev = Device::new(0)?;
    let weights = DeviceWeights::dummy(&cfg, &dev.k, dev.stream(), 11)?;
    let pages = (context + 1).div_ceil(PAGE_SIZE);
    let max_len = context.max(prefill_len) + PAGE_SIZE;
    let opts = ModelOptions {
        limits: Limits {
            max_tokens: prefill_len.max(batch),
            max_seqs: batch,
            max_logit_rows: batch,
            max_kv_chunk: prefill_len.max(16384),
        },
        gpu_memory_utilization: 0.9,
        num_blocks: Some(batch * pages + prefill_len.div_ceil(PAGE_SIZE)),
        max_model_len: max_len,
    };
    let mut model = CudaModel::new(&dev, cfg.clone(), weights, &opts)?;
    dev.k.fill_normal_bf16(dev.stream(), model.cache.slice(), Normal { mean: 0.0, std: 1.0, seed: 12 })?;
    dev.gpu.sync()?;
    let decode = |j: usize| StepPlan {
        kind: StepKind::Decode,
        seqs: (0..batch)
            .map(|i| SeqStep {
                seq_id: i as u64,
                tokens: vec![(17 * i + j) as u32 % cfg.vocab_size as u32],
                context_len: context,
                block_table: ((i * pages) as u32..((i + 1) * pages) as u32).collect(),
                logits: LogitsRequest::None,
                sample: greedy(),
            })
            .collect(),
    };
    let base = (batch * pages) as u32;
    let prefill = |j: usize| StepPlan {
        kind: StepKind::Prefill,
        seqs: vec![SeqStep {
            seq_id: 0,
            tokens: (0..prefill_len).map(|t| ((31 * t + j) % cfg.vocab_size) as u32).collect(),
            context_len: 0,
            block_table: (base..base + prefill_len.div_ceil(PAGE_SIZE) as u32).collect(),
            logits: LogitsRequest::None,
            sample: greedy(),
        }],
    };
    for j in 0..3 {
        model.step(&dev, &decode(j))?;
        model.step(&dev, &prefill(j))?;
    }
    let t = std::time::Instant::now();
    model.step(&dev, &decode(5))?;
    let decode_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = std::time::Instant::now();
    model.step(&dev, &prefill(5))?;
    let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
    eprintln!("eager decode step B={batch} ctx={context}: {decode_ms:.2} ms; prefill of {prefill_len} tokens: {prefill_ms:.2} ms");
    // SAFETY: plain driver calls on the current context; they only toggle profiling.
    unsafe { cudarc::driver::sys::cuProfilerStart() };
    model.step(&dev, &decode(9))?;
    model.step(&dev, &prefill(9))?;
    // SAFETY: as cuProfilerStart above.
    unsafe { cudarc::driver::sys::cuProfilerStop() };
    Ok(())
}
