//! DeepSeekMoE for steps of a few tokens as weight-streaming GEMVs (`kernels/moe_gemv.cu`):
//! router, routing, gate/up with SiLU·mul, down with the weighted combine; routed and shared
//! experts in the same launches. Four launches per layer instead of the grouped path's twelve,
//! which at B=1 are each a few microseconds of latency for little work.

use super::weights::MoeWeights;
use crate::device::Device;
use crate::gpu::{Arg, DSlice, Kernel};
use crate::ops::MoeRouting;
use half::bf16;
use mla_core::ModelConfig;

/// Most tokens a step may have for this path. Each routed slot reads its expert's weights, so
/// past a few tokens (experts shared between tokens) the grouped GEMMs read less.
pub const MOE_GEMV_MAX_TOKENS: usize = 4;
const WARPS: usize = 4; // WARPS in moe_gemv.cu

pub struct MoeSmall {
    router: Kernel,
    gate_up: Kernel,
    down: Kernel,
    /// Blocks of the gate/up kernel that fit on the GPU at once (its grid is one wave).
    gate_up_wave: usize,
    /// The same for the down kernel, whose block size depends on the model (set at first use).
    down_wave: std::cell::OnceCell<usize>,
    sm_count: usize,
    pub enabled: bool,
}

/// Buffers of one layer's small-step MoE.
pub struct MoeSmallIo<'a> {
    pub tokens: usize,
    pub x: DSlice<bf16>,
    pub router_logits: DSlice<f32>,
    pub routing: &'a MoeRouting,
    /// [tokens * top_k, I]
    pub act: DSlice<bf16>,
    /// [tokens, Is]
    pub act_shared: DSlice<bf16>,
    pub out: DSlice<bf16>,
}

impl MoeSmall {
    pub fn load(dev: &Device, enabled: bool) -> anyhow::Result<Self> {
        let gate_up = dev.kernel("moe_gemv", "moe_gemv_gate_up")?;
        let sm_count = dev.k.sm_count;
        Ok(MoeSmall {
            router: dev.kernel("moe_gemv", "moe_router_gemv")?,
            gate_up_wave: sm_count * gate_up.max_active_blocks_per_sm((32 * WARPS) as u32, 0)?,
            gate_up,
            down: dev.kernel("moe_gemv", "moe_gemv_down")?,
            down_wave: std::cell::OnceCell::new(),
            sm_count,
            enabled,
        })
    }

    /// Slices of the shared experts' intermediate each down-projection warp takes (Is = pieces ·
    /// I), or None when the shape does not split evenly (the grouped path runs then).
    fn shared_pieces(cfg: &ModelConfig, w: &MoeWeights) -> Option<usize> {
        match &w.shared {
            None => Some(0),
            Some(sh) => {
                let (ims, im) = (sh.down.inp, cfg.moe_intermediate_size);
                (ims % im == 0).then_some(ims / im)
            }
        }
    }

    /// Whether this path takes a step of `tokens` tokens for this layer.
    pub fn takes(&self, cfg: &ModelConfig, w: &MoeWeights, tokens: usize) -> bool {
        self.enabled
            && (1..=MOE_GEMV_MAX_TOKENS).contains(&tokens)
            && cfg.hidden_size.is_multiple_of(8)
            && cfg.moe_intermediate_size.is_multiple_of(8)
            && Self::shared_pieces(cfg, w).is_some_and(|p| cfg.num_experts_per_tok + p <= 32)
    }

    /// Router logits (f32, as HF) for `io.tokens` rows of `io.x`.
    pub fn router(&self, dev: &Device, cfg: &ModelConfig, w: &MoeWeights, io: &MoeSmallIo) -> anyhow::Result<()> {
        let (t, e, h) = (io.tokens, cfg.n_routed_experts, cfg.hidden_size);
        anyhow::ensure!(
            io.x.len >= t * h && io.router_logits.len >= t * e && w.router.len() >= e * h,
            "moe router: buffers too small"
        );
        self.router.launch(
            dev.stream(),
            ((t * e).div_ceil(WARPS) as u32, 1, 1),
            (32 * WARPS) as u32,
            0,
            &[
                Arg::Ptr(io.x.ptr),
                Arg::Ptr(w.router.slice().ptr),
                Arg::I32(t as i32),
                Arg::I32(e as i32),
                Arg::I32(h as i32),
                Arg::Ptr(io.router_logits.ptr),
            ],
        )?;
        Ok(())
    }

    /// Gate/up with SiLU·mul, then down with the combine into `io.out`, after routing filled
    /// `io.routing`'s top-k ids and weights.
    pub fn experts(&self, dev: &Device, cfg: &ModelConfig, w: &MoeWeights, io: &MoeSmallIo) -> anyhow::Result<()> {
        let (t, k, h, im) = (io.tokens, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size);
        let pieces = Self::shared_pieces(cfg, w)
            .ok_or_else(|| anyhow::anyhow!("shared experts do not split into moe_intermediate_size slices"))?;
        let ims = pieces * im;
        anyhow::ensure!(
            io.act.len >= t * k * im && io.act_shared.len >= t * ims && io.out.len >= t * h,
            "moe gemv: buffers too small"
        );
        let (sh_gu, sh_down) = match &w.shared {
            Some(sh) => (sh.gate_up.buf.slice().ptr, sh.down.buf.slice().ptr),
            None => (0, 0),
        };
        let items = t * k * im + if pieces > 0 { t * ims } else { 0 };
        // One wave of blocks whose warps stride over the items (no ragged last wave).
        self.gate_up.launch(
            dev.stream(),
            (items.div_ceil(WARPS).min(self.gate_up_wave) as u32, 1, 1),
            (32 * WARPS) as u32,
            0,
            &[
                Arg::Ptr(io.x.ptr),
                Arg::I32(h as i32),
                Arg::I32(t as i32),
                Arg::Ptr(io.routing.topk_ids.ptr),
                Arg::I32(k as i32),
                Arg::Ptr(w.gate_up.slice().ptr),
                Arg::I32(im as i32),
                Arg::Ptr(sh_gu),
                Arg::I32(ims as i32),
                Arg::Ptr(io.act.ptr),
                Arg::Ptr(io.act_shared.ptr),
            ],
        )?;
        let down_threads = (32 * (k + pieces)) as u32;
        // Same for the down kernel; its block size is fixed per model, so ask once.
        let wave = match self.down_wave.get() {
            Some(&w) => w,
            None => {
                let w = self.sm_count * self.down.max_active_blocks_per_sm(down_threads, 0)?;
                let _ = self.down_wave.set(w);
                w
            }
        };
        self.down.launch(
            dev.stream(),
            ((h / 2).min(wave.div_ceil(t).max(1)) as u32, t as u32, 1),
            down_threads,
            0,
            &[
                Arg::Ptr(io.act.ptr),
                Arg::I32(im as i32),
                Arg::Ptr(w.down.slice().ptr),
                Arg::Ptr(io.routing.topk_ids.ptr),
                Arg::Ptr(io.routing.topk_w.ptr),
                Arg::I32(k as i32),
                Arg::Ptr(io.act_shared.ptr),
                Arg::I32(ims as i32),
                Arg::Ptr(sh_down),
                Arg::I32(pieces as i32),
                Arg::Ptr(io.out.ptr),
                Arg::I32(h as i32),
            ],
        )?;
        Ok(())
    }
}
