//! DeepSeekMoE for steps of a few tokens as weight-streaming GEMVs (`ops::MoeGemvKernels`):
//! after the router GEMV and the top-k (in `ffn_layer`, which both MoE paths share up to
//! `ops::ROUTER_GEMV_MAX_TOKENS` tokens), gate/up with SiLU·mul and down with the weighted
//! combine; routed and shared experts in the same launches. Four launches per layer instead of
//! the grouped path's twelve, which at B=1 are each a few microseconds of latency for little
//! work. This module decides when the path applies and maps a layer's weights onto the kernels'
//! arguments.

use super::weights::MoeWeights;
use crate::device::Device;
use crate::gpu::DSlice;
use crate::ops::dims::MOE_GEMV_WARPS;
use crate::ops::{MoeGemvExperts, MoeRouting};
use half::bf16;
use mla_core::ModelConfig;

/// Buffers of one layer's small-step MoE.
pub struct MoeSmallIo<'a> {
    pub tokens: usize,
    pub x: DSlice<'a, bf16>,
    pub routing: &'a MoeRouting<'a>,
    /// [tokens * top_k, I]
    pub act: DSlice<'a, bf16>,
    /// [tokens, Is]
    pub act_shared: DSlice<'a, bf16>,
    pub out: DSlice<'a, bf16>,
}

/// Slices of the shared experts' intermediate each down-projection warp takes (Is = pieces · I),
/// or None when the shape does not split evenly (the grouped path runs then).
fn shared_pieces(cfg: &ModelConfig, w: &MoeWeights) -> Option<usize> {
    match &w.shared {
        None => Some(0),
        Some(sh) => {
            let (ims, im) = (sh.down.inp, cfg.moe_intermediate_size);
            ims.is_multiple_of(im).then_some(ims / im)
        }
    }
}

/// Whether this path takes a step of `tokens` tokens for this layer (at most `max_tokens`:
/// `ops::MoeGemvKernels::max_tokens`).
pub fn takes(cfg: &ModelConfig, w: &MoeWeights, tokens: usize, max_tokens: usize) -> bool {
    (1..=max_tokens).contains(&tokens)
        && cfg.hidden_size.is_multiple_of(4 * MOE_GEMV_WARPS)
        && cfg.moe_intermediate_size.is_multiple_of(8)
        && shared_pieces(cfg, w).is_some_and(|p| cfg.num_experts_per_tok + p <= 32)
}

/// Gate/up with SiLU·mul, then down with the combine into `io.out`, after routing filled
/// `io.routing`'s top-k ids and weights.
pub fn experts(dev: &Device, cfg: &ModelConfig, w: &MoeWeights, io: &MoeSmallIo) -> anyhow::Result<()> {
    let pieces = shared_pieces(cfg, w)
        .ok_or_else(|| anyhow::anyhow!("shared experts do not split into moe_intermediate_size slices"))?;
    let p = MoeGemvExperts {
        tokens: io.tokens,
        top_k: cfg.num_experts_per_tok,
        hidden: cfg.hidden_size,
        inter: cfg.moe_intermediate_size,
        shared_pieces: pieces,
        x: io.x,
        topk_ids: io.routing.topk_ids,
        topk_w: io.routing.topk_w,
        gate_up: w.gate_up.mats(),
        down: w.down.mats(),
        shared: w.shared.as_ref().map(|sh| (sh.gate_up.expert_mats(), sh.down.expert_mats())),
        act: io.act,
        act_shared: io.act_shared,
        out: io.out,
    };
    dev.k.moe_gemv.experts(dev.stream(), &p)
}
