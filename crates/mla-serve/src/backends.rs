//! Building the compute backends the flags ask for, with their KV caches sized: the CPU
//! reference backend (f32, cache sized here; `--tp`/`--dp`/`--enable-dp-attention` run as
//! threads, the correctness reference for the GPU ranks) or the CUDA backend (bf16, cache sized
//! from free GPU memory by `--gpu-memory-utilization`, or fixed by `--kv-cache-tokens`). One
//! backend per replica (`--dp` without DP attention); the engine routes between them.

use crate::cli::{Args, Device};
use crate::model_source::ModelSource;
use crate::sizing::{self, Sizing};
use anyhow::bail;
use mla_core::{Backend, CacheLayout, ModelConfig, ModelSpec, Parallel};
use mla_cpu::CpuBackend;
use mla_cuda::model::memory_plan::BudgetFit;
use mla_cuda::ops::PAGE_SIZE;
use mla_cuda::CudaOptions;

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

/// The backends of one server: one per replica, each with the same cache sizing per attention
/// rank (`sizing`).
pub struct Loaded {
    pub backends: Vec<Box<dyn Backend>>,
    pub sizing: Sizing,
}

/// Builds the backends for a resolved device (`resolve_device` first).
pub fn load(device: Device, source: &ModelSource, args: &Args, parallel: Parallel) -> anyhow::Result<Loaded> {
    parallel.check(&source.config)?;
    if let Some(r) = args.speculative.request()? {
        check_speculative(source, r.draft_tokens)?;
    }
    match device {
        Device::Cuda => cuda(source, args, parallel),
        Device::Cpu => cpu(source, args, parallel),
        Device::Auto => bail!("internal error: --device auto must be resolved before loading"),
    }
}

/// Whether speculative decoding with the MTP layer can run: the model has the layer and the
/// number of drafts is one the layer can chain (docs/speculative-decoding.md). Every layout runs
/// it: one rank, `--tp N`, `--dp N`, DP attention and several nodes.
fn check_speculative(source: &ModelSource, drafts: usize) -> anyhow::Result<()> {
    let cfg = &source.config;
    if cfg.num_nextn_predict_layers == 0 {
        bail!(
            "speculative decoding with MTP: {} has no multi-token-prediction layer (num_nextn_predict_layers is 0; DeepSeek-V3 and R1 have one)",
            source.name
        );
    }
    if !(1..=MAX_DRAFTS).contains(&drafts) {
        bail!("speculative decoding with MTP: {drafts} draft tokens per step; 1 to {MAX_DRAFTS} are supported");
    }
    Ok(())
}

/// More drafts than this from one MTP layer chained on itself would mostly be rejected.
const MAX_DRAFTS: usize = 8;

fn cpu(source: &ModelSource, args: &Args, parallel: Parallel) -> anyhow::Result<Loaded> {
    let sizing = sizing::cpu_sizing(&source.config, args)?;
    let cfg = source.config.clone();
    // Every rank keeps a whole latent cache (under TP each keeps the same one; under DP
    // attention each its own), and holds its shards plus the replicated tensors.
    // With several nodes, this node holds its share of the ranks.
    let spec = ModelSpec::new(&cfg);
    let copy_params: usize = (0..parallel.tp).map(|r| parallel.rank(r).params(&spec)).sum();
    let nodes = args.nnodes;
    sizing::check_cpu_memory(parallel.replicas * copy_params / nodes, parallel.devices() / nodes, &sizing)?;
    let cache = CacheLayout { block_size: sizing.block_size, num_blocks: sizing.num_blocks };
    if nodes > 1 {
        let group = crate::nodes::start_as_node0(args, source, Device::Cpu, cuda_options(args), Some(cache))?;
        return Ok(Loaded { backends: vec![group], sizing });
    }
    let weights = source.host_weights()?;
    let kv_dtype = args.kv_cache_dtype()?;
    let one_copy = Parallel { replicas: 1, ..parallel };
    // The CPU reference is held to the same step limits as the GPU ranks of this layout.
    let (step, _) = args.step_limits(&parallel)?;
    let mut backends: Vec<Box<dyn Backend>> = Vec::with_capacity(parallel.replicas);
    for _ in 0..parallel.replicas {
        backends.push(if one_copy.is_single() {
            let b = CpuBackend::with_cache_dtype(
                cfg.clone(),
                weights.as_ref(),
                cache.block_size,
                cache.num_blocks,
                kv_dtype,
            )?;
            let b = match args.speculative.request()? {
                Some(_) => b.with_mtp(weights.as_ref())?,
                None => b,
            };
            Box::new(b.with_step_limits(step))
        } else {
            let group = mla_cpu::group::local_group(
                cfg.clone(),
                weights.clone(),
                one_copy,
                cache,
                kv_dtype,
                step,
                args.watchdog(),
                args.speculative.request()?.is_some(),
            );
            Box::new(group?)
        });
    }
    Ok(Loaded { backends, sizing })
}

/// What every node checks before its CUDA ranks start.
fn check_cuda(source: &ModelSource, args: &Args, parallel: Parallel) -> anyhow::Result<()> {
    if args.block_size != PAGE_SIZE {
        bail!("--block-size {}: the CUDA backend's kernels use blocks of {PAGE_SIZE} tokens", args.block_size);
    }
    let max_pos = source.config.max_position_embeddings;
    if let Some(m) = args.max_model_len.filter(|&m| m > max_pos) {
        bail!("--max-model-len {m} exceeds the model's max_position_embeddings ({max_pos})");
    }
    mla_cuda::model::check_supported(&source.config)?;
    let here = parallel.devices() / args.nnodes;
    let visible = mla_cuda::visible_gpus();
    if args.nnodes > 1 && here > visible {
        bail!(
            "this node holds {here} ranks of --tp {} over --nnodes {} but sees {visible} GPUs",
            parallel.tp,
            args.nnodes
        );
    }
    Ok(())
}

fn cuda(source: &ModelSource, args: &Args, parallel: Parallel) -> anyhow::Result<Loaded> {
    check_cuda(source, args, parallel)?;
    let cfg = &source.config;
    let max_pos = cfg.max_position_embeddings;
    let backends = if args.nnodes > 1 {
        vec![crate::nodes::start_as_node0(args, source, Device::Cuda, cuda_options(args), None)?]
    } else {
        mla_cuda::layout::backends_for(cfg, &source.cuda_weights(), &cuda_options(args), parallel, args.watchdog())?
    };
    let smallest = backends.iter().flat_map(|b| b.cache_layouts()).map(|l| l.num_blocks).min().unwrap_or(0);
    let capacity = smallest * PAGE_SIZE;
    let max_model_len = match args.max_model_len {
        Some(m) if m > capacity => bail!(
            "--max-model-len {m} does not fit the KV cache of {capacity} tokens; raise --gpu-memory-utilization or --kv-cache-tokens, or lower --max-model-len, --max-num-batched-tokens or --max-num-seqs"
        ),
        Some(m) => m,
        None => max_pos.min(capacity),
    };
    // The CUDA cache holds bf16 values or FP8 rows, for the MTP module's layer too when it runs.
    let layers = cfg.num_hidden_layers + usize::from(args.speculative.request()?.is_some());
    let bytes_per_token = layers * mla_cuda::ops::cache_row_bytes(args.kv_cache_dtype()?);
    let sizing = Sizing { num_blocks: smallest, block_size: PAGE_SIZE, max_model_len, bytes_per_token };
    Ok(Loaded { backends, sizing })
}

/// A node other than 0 of `--nnodes`: starts its ranks and serves them for node 0 until node 0
/// stops (see `nodes`).
pub fn serve_for_node0(device: Device, source: &ModelSource, args: &Args, parallel: Parallel) -> anyhow::Result<()> {
    parallel.check(&source.config)?;
    match device {
        Device::Cuda => {
            check_cuda(source, args, parallel)?;
            crate::nodes::serve_as_other_node(args, source, device, cuda_options(args), None)
        }
        Device::Cpu => {
            let sizing = sizing::cpu_sizing(&source.config, args)?;
            let cache = CacheLayout { block_size: sizing.block_size, num_blocks: sizing.num_blocks };
            crate::nodes::serve_as_other_node(args, source, device, cuda_options(args), Some(cache))
        }
        Device::Auto => bail!("internal error: --device auto must be resolved before loading"),
    }
}

fn cuda_options(args: &Args) -> CudaOptions {
    CudaOptions {
        gpu_memory_utilization: args.gpu_memory_utilization.unwrap_or(CudaOptions::default().gpu_memory_utilization),
        max_num_batched_tokens: args.max_num_batched_tokens(),
        // A budget the user gave is kept; the default may shrink for the KV cache.
        budget_fit: if args.max_num_batched_tokens.is_some() { BudgetFit::Fixed } else { BudgetFit::Shrink },
        max_num_seqs: args.max_num_seqs,
        max_model_len: args.max_model_len,
        num_blocks: args.kv_cache_tokens.map(|t| t.div_ceil(PAGE_SIZE)),
        // vLLM's --enforce-eager: no decode step replayed from a graph.
        cuda_graph_batch_sizes: if args.compat.enforce_eager {
            vec![]
        } else {
            CudaOptions::default().cuda_graph_batch_sizes
        },
        // Checked when the flags were read (Args::check_quantization).
        kv_cache_dtype: args.kv_cache_dtype().unwrap_or_default(),
        // Checked when the backends were asked for (check_speculative).
        mtp_drafts: args.speculative.request().ok().flatten().map_or(0, |r| r.draft_tokens),
        ..CudaOptions::default()
    }
}
