//! Building the compute backend the flags ask for, with its KV cache sized: the CPU reference
//! backend (f32, cache sized here) or the CUDA backend (bf16, cache sized from free GPU memory
//! by `--gpu-memory-utilization`, or fixed by `--kv-cache-tokens`).

use crate::cli::{Args, Device};
use crate::model_source::{ModelSource, WeightsFrom};
use crate::sizing::{self, Sizing};
use anyhow::bail;
use mla_core::{Backend, Checkpoint, DummyWeights, ModelConfig};
use mla_cpu::CpuBackend;
use mla_cuda::ops::PAGE_SIZE;
use mla_cuda::{CudaBackend, CudaOptions};

/// Turns `--device auto` into cuda or cpu for this model, as a vLLM user expects on a GPU node:
/// the GPU when it can serve the model, otherwise the CPU with the reason in the log.
pub fn resolve_device(requested: Device, config: &ModelConfig, args: &Args) -> anyhow::Result<Device> {
    if requested != Device::Auto {
        return Ok(requested);
    }
    let reason = if !mla_cuda::kernels_built() {
        Some("this binary was built without CUDA kernels (nvcc was not found at build time)".to_string())
    } else if mla_cuda::visible_gpus() == 0 {
        Some("no NVIDIA GPU is visible".to_string())
    } else {
        mla_cuda::model::check_supported(config).err().map(|e| e.to_string())
    };
    match reason {
        None => {
            tracing::info!("--device auto: using cuda");
            Ok(Device::Cuda)
        }
        Some(why) => {
            if let Some(u) = args.gpu_memory_utilization {
                bail!("--gpu-memory-utilization {u} was given, but --device auto chose cpu: {why}");
            }
            tracing::info!("--device auto: using cpu because {why}");
            Ok(Device::Cpu)
        }
    }
}

/// Builds the backend for a resolved device (`resolve_device` first).
pub fn load(
    device: Device,
    source: &ModelSource,
    args: &Args,
    params: usize,
) -> anyhow::Result<(Box<dyn Backend>, Sizing)> {
    match device {
        Device::Cuda => cuda(source, args),
        Device::Cpu => cpu(source, args, params),
        Device::Auto => bail!("internal error: --device auto must be resolved before loading"),
    }
}

fn cpu(source: &ModelSource, args: &Args, params: usize) -> anyhow::Result<(Box<dyn Backend>, Sizing)> {
    let sizing = sizing::cpu_sizing(&source.config, args)?;
    sizing::check_cpu_memory(params, &sizing)?;
    let cfg = source.config.clone();
    let backend = match &source.weights {
        WeightsFrom::Checkpoint(dir) => {
            let checkpoint = Checkpoint::open(dir, &cfg)?;
            CpuBackend::new(cfg, &checkpoint, sizing.block_size, sizing.num_blocks)?
        }
        WeightsFrom::Dummy { seed } => {
            CpuBackend::new(cfg, &DummyWeights::new(*seed), sizing.block_size, sizing.num_blocks)?
        }
    };
    Ok((Box::new(backend), sizing))
}

fn cuda(source: &ModelSource, args: &Args) -> anyhow::Result<(Box<dyn Backend>, Sizing)> {
    if args.block_size != PAGE_SIZE {
        bail!("--block-size {}: the CUDA backend's kernels use blocks of {PAGE_SIZE} tokens", args.block_size);
    }
    let cfg = &source.config;
    let max_pos = cfg.max_position_embeddings;
    if let Some(m) = args.max_model_len.filter(|&m| m > max_pos) {
        bail!("--max-model-len {m} exceeds the model's max_position_embeddings ({max_pos})");
    }
    let weights = match &source.weights {
        WeightsFrom::Checkpoint(dir) => mla_cuda::WeightsFrom::Checkpoint(dir.clone()),
        // The demo draws the same host-side weights as on the CPU, so both give the same replies;
        // big dummy models are drawn on the device, which is much faster.
        WeightsFrom::Dummy { seed } if source.is_demo => {
            mla_cuda::WeightsFrom::Host(Box::new(DummyWeights::new(*seed)))
        }
        WeightsFrom::Dummy { seed } => mla_cuda::WeightsFrom::DummyOnDevice { seed: *seed },
    };
    let options = CudaOptions {
        gpu_memory_utilization: args.gpu_memory_utilization.unwrap_or(CudaOptions::default().gpu_memory_utilization),
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        max_model_len: args.max_model_len,
        num_blocks: args.kv_cache_tokens.map(|t| t.div_ceil(PAGE_SIZE)),
        ..CudaOptions::default()
    };
    let backend = CudaBackend::new(cfg.clone(), weights, options)?;
    let layout = backend.cache_layout();
    let capacity = layout.capacity_tokens();
    let max_model_len = match args.max_model_len {
        Some(m) if m > capacity => bail!(
            "--max-model-len {m} does not fit the KV cache of {capacity} tokens; raise --gpu-memory-utilization or --kv-cache-tokens, or lower --max-model-len"
        ),
        Some(m) => m,
        None => max_pos.min(capacity),
    };
    // The CUDA cache holds bf16 values.
    let bytes_per_token = cfg.num_hidden_layers * cfg.kv_cache_dim() * 2;
    let sizing =
        Sizing { num_blocks: layout.num_blocks, block_size: layout.block_size, max_model_len, bytes_per_token };
    Ok((Box::new(backend), sizing))
}
