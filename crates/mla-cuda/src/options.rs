//! What a CUDA backend is started with: where its weights come from and its options (step
//! budget, memory share, CUDA graphs, kernel choices).

use crate::model::memory_plan::BudgetFit;
use mla_core::{KvCacheDtype, StepBudget, WeightSource};
use std::path::PathBuf;
use std::sync::Arc;

/// Where the weights come from.
#[derive(Clone)]
pub enum WeightsFrom {
    /// A HF model directory (bf16, or block-FP8 kept in FP8; `model::weights`).
    Checkpoint(PathBuf),
    /// `--load-format dummy`: random values drawn on the device (fast, any size).
    DummyOnDevice { seed: u64 },
    /// Any host-side source, e.g. mla-core's `DummyWeights` to compare with the CPU backend.
    Host(Arc<dyn WeightSource + Send + Sync>),
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
    /// FP8 projections of prefill-sized steps in W8A8 through cuBLASLt's block-scaled GEMM (the
    /// engines' numerics and speed), else dequantized to bf16 for cuBLAS (exact W8A16; tests).
    pub fp8_w8a8: bool,
    /// What the latent cache stores: bf16 rows or FP8 rows (`--kv-cache-dtype`).
    pub kv_cache_dtype: KvCacheDtype,
    /// Whether `max_num_batched_tokens` may shrink to leave the KV cache room (the server's
    /// default budget) or is kept as given (`model::memory_plan`).
    pub budget_fit: BudgetFit,
    /// Speculative decoding: drafts per step from the model's MTP module, which is loaded with
    /// its own cache layer (0: off, the module's tensors are not read).
    pub mtp_drafts: usize,
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
            fp8_w8a8: true,
            kv_cache_dtype: KvCacheDtype::Auto,
            budget_fit: BudgetFit::Fixed,
            mtp_drafts: 0,
        }
    }
}

impl CudaOptions {
    /// What the flags ask of one step, before the layout (`mla_core::StepLimits::derive`).
    pub fn budget(&self) -> StepBudget {
        StepBudget {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_extra_logit_rows: self.max_extra_logit_rows,
        }
    }

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
