//! What a CUDA model is built with: the step limits, how the memory planner may treat them, the
//! cache and the kernels' options.

use super::memory_plan::BudgetFit;
use mla_core::{KvCacheDtype, StepLimits};

#[derive(Debug, Clone)]
pub struct ModelOptions {
    /// The largest step the flags ask for (`mla_core::StepLimits::derive`); the memory planner
    /// may halve its token budget (`memory_plan`).
    pub step_limits: StepLimits,
    /// Whether the token budget may shrink to make room for the KV cache.
    pub fit: BudgetFit,
    /// Tokens the KV cache should hold before a default budget is kept (`memory_plan`).
    pub kv_goal_tokens: usize,
    /// Cached keys decompressed per prefill pass (at least a step's tokens).
    pub max_kv_chunk: usize,
    /// Fraction of device memory for weights, activations and the KV cache together.
    pub gpu_memory_utilization: f64,
    /// Fixed cache size in blocks instead of sizing from memory (tests).
    pub num_blocks: Option<usize>,
    /// Longest sequence (prompt + output) the backend accepts.
    pub max_model_len: usize,
    /// Single-row projections through the weight-streaming GEMV instead of cuBLAS (`SmallLinear`).
    pub small_batch_gemv: bool,
    /// FP8 projections of steps past the GEMV's rows in W8A8 through cuBLASLt's block-scaled GEMM
    /// (sm_90 only); off, or on other GPUs, they dequantize to bf16 for cuBLAS (`SmallLinear`).
    pub fp8_w8a8: bool,
    /// What the latent cache stores (bf16 or FP8 rows).
    pub kv_cache_dtype: KvCacheDtype,
    /// Speculative decoding: drafts per step from the MTP module (0: off). The weights must hold
    /// the module; a verify step runs `1 + mtp_drafts` rows per sequence (`model::speculative`).
    pub mtp_drafts: usize,
}

impl ModelOptions {
    /// Options for a fixed step shape and cache (tests and benchmarks): `tokens` per step,
    /// `seqs` sequences, `logit_rows` rows of logits, one rank.
    pub fn fixed(tokens: usize, seqs: usize, logit_rows: usize, max_kv_chunk: usize) -> Self {
        ModelOptions {
            step_limits: StepLimits {
                rank_tokens: tokens,
                rank_seqs: seqs,
                rank_logit_rows: logit_rows,
                gathered_ranks: 1,
            },
            fit: BudgetFit::Fixed,
            kv_goal_tokens: 0,
            max_kv_chunk,
            gpu_memory_utilization: 0.9,
            num_blocks: None,
            max_model_len: usize::MAX,
            small_batch_gemv: true,
            fp8_w8a8: true,
            kv_cache_dtype: KvCacheDtype::Auto,
            mtp_drafts: 0,
        }
    }
}
