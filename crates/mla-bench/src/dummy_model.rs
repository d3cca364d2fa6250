//! A model with dummy weights whose latent cache is filled with random values, and decode steps
//! over it: a cache of random latents stands in for the prefilled context of every sequence, so
//! decode can be measured (or profiled) at any context without prefilling the batch first.

use mla_core::step::plan::{LogitsRequest, SampleRequest, SeqStep, StepKind, StepPlan};
use mla_core::{ModelConfig, SamplingParams};
use mla_cuda::model::{CudaModel, DeviceWeights, ModelOptions};
use mla_cuda::ops::Normal;
use mla_cuda::Device;

/// The config at `path` as mla-serve would run it with `--hf-overrides` and `--quantization`.
pub fn config(
    path: &std::path::Path,
    hf_overrides: Option<&str>,
    quantization: Option<&str>,
) -> anyhow::Result<ModelConfig> {
    let overrides = match hf_overrides {
        Some(t) => mla_core::model::json_patch::parse_overrides(t).map_err(anyhow::Error::msg)?,
        None => Default::default(),
    };
    let mut cfg = ModelConfig::from_file_with_overrides(path, &overrides)?;
    if let Some(method) = quantization {
        cfg.apply_quantization_flag(method).map_err(anyhow::Error::msg)?;
    }
    Ok(cfg)
}

/// `CudaModel::new` over weights drawn on the device, with the whole cache drawn from N(0, 1) (an
/// FP8 cache: valid rows of random codes of about that spread).
/// With `opts.mtp_drafts` > 0 the weights hold an MTP module (and the cache its layer).
pub fn build(dev: &Device, cfg: &ModelConfig, opts: &ModelOptions) -> anyhow::Result<CudaModel> {
    let weights = DeviceWeights::dummy_with(cfg, dev, 11, opts.mtp_drafts > 0)?;
    let model = CudaModel::new(dev, cfg.clone(), weights, opts)?;
    if model.cache_dtype.is_fp8() {
        for l in 0..model.cache_layers() {
            dev.k.latent.fill_fp8_random(dev.stream(), model.layer_cache(l), 12 + l as u64)?;
        }
    } else {
        // SAFETY: a bf16 cache's bytes are bf16 values.
        let values = unsafe { model.cache.slice().reinterpret(model.cache.len() / 2) };
        dev.k.elementwise.fill_normal_bf16(dev.stream(), values, Normal { mean: 0.0, std: 1.0, seed: 12 })?;
    }
    dev.gpu.sync()?;
    Ok(model)
}

/// Decode step `j` of `batch` greedy sequences at `context_len`: sequence `i` owns blocks
/// `i * blocks_per_seq ..` and feeds a token that changes with `i` and `j`.
pub fn decode_plan(batch: usize, context_len: usize, blocks_per_seq: usize, j: usize, vocab: usize) -> StepPlan {
    StepPlan {
        kind: StepKind::Decode,
        seqs: (0..batch)
            .map(|i| SeqStep {
                fork: None,
                seq_id: i as u64,
                tokens: vec![((17 * i + j) % vocab) as u32],
                context_len,
                block_table: ((i * blocks_per_seq) as u32..((i + 1) * blocks_per_seq) as u32).collect(),
                logits: LogitsRequest::None,
                sample: Some(greedy(i as u64)),
                mtp: None,
            })
            .collect(),
    }
}

pub fn greedy(seed: u64) -> SampleRequest {
    SampleRequest {
        params: SamplingParams::greedy(),
        seed,
        top_logprobs: None,
        penalty: None,
        logit_bias: Vec::new(),
        allowed: None,
    }
}
