//! kernels/moe_gemv.cu: DeepSeekMoE for steps of a few tokens as weight-streaming GEMVs: the
//! router, gate/up with SiLU·mul, and down with the weighted combine, routed and shared experts in
//! the same launches. When the model takes this path is `model::moe_small`'s decision.

use super::dims::MOE_GEMV_WARPS;
use crate::gpu::{Arg, DSlice, GpuInfo, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;
use std::cell::RefCell;

pub struct MoeGemvKernels {
    router: Kernel,
    gate_up: Kernel,
    down: Kernel,
    /// Blocks of the gate/up kernel that fit on the GPU at once (its grid is one wave).
    gate_up_wave: usize,
    /// The same for the down kernel by block size, which depends on the model (asked at first use).
    down_waves: RefCell<Vec<(u32, usize)>>,
    sm_count: usize,
}

/// Router logits (f32, as HF): `logits[t, e] = x[t] · router[e]`.
pub struct MoeGemvRouter<'a> {
    pub tokens: usize,
    pub experts: usize,
    pub hidden: usize,
    pub x: DSlice<'a, bf16>,
    /// `[experts, hidden]` f32, as HF computes routing.
    pub router: DSlice<'a, f32>,
    pub logits: DSlice<'a, f32>,
}

/// The experts of a routed step: `out[t] = Σ_j w[t, j] · down_e(act) + shared(x[t])`.
pub struct MoeGemvExperts<'a> {
    pub tokens: usize,
    pub top_k: usize,
    pub hidden: usize,
    /// moe_intermediate_size: the width of one routed expert.
    pub inter: usize,
    /// The shared experts' width in routed-expert widths (Is = pieces · inter); 0 without them.
    pub shared_pieces: usize,
    pub x: DSlice<'a, bf16>,
    pub topk_ids: DSlice<'a, i32>,
    pub topk_w: DSlice<'a, f32>,
    /// `[experts, 2·inter, hidden]` and `[experts, hidden, inter]`.
    pub gate_up: DSlice<'a, bf16>,
    pub down: DSlice<'a, bf16>,
    /// The shared experts' `[2·Is, hidden]` and `[hidden, Is]`, when `shared_pieces > 0`.
    pub shared: Option<(DSlice<'a, bf16>, DSlice<'a, bf16>)>,
    /// `[tokens · top_k, inter]` and `[tokens, Is]` scratch.
    pub act: DSlice<'a, bf16>,
    pub act_shared: DSlice<'a, bf16>,
    pub out: DSlice<'a, bf16>,
}

impl MoeGemvKernels {
    pub fn load(m: &Modules, info: &GpuInfo) -> anyhow::Result<Self> {
        let k = |name| m.kernel("moe_gemv", name);
        let gate_up = k("moe_gemv_gate_up")?;
        Ok(MoeGemvKernels {
            router: k("moe_router_gemv")?,
            gate_up_wave: info.sm_count * gate_up.max_active_blocks_per_sm((32 * MOE_GEMV_WARPS) as u32, 0)?,
            gate_up,
            down: k("moe_gemv_down")?,
            down_waves: RefCell::default(),
            sm_count: info.sm_count,
        })
    }

    pub fn router(&self, s: CUstream, p: &MoeGemvRouter) -> anyhow::Result<()> {
        let (t, e, h) = (p.tokens, p.experts, p.hidden);
        anyhow::ensure!(
            p.x.len >= t * h && p.logits.len >= t * e && p.router.len >= e * h,
            "moe router: buffers too small"
        );
        self.router.launch(
            s,
            ((t * e).div_ceil(MOE_GEMV_WARPS) as u32, 1, 1),
            (32 * MOE_GEMV_WARPS) as u32,
            0,
            &[
                Arg::Ptr(p.x.ptr),
                Arg::Ptr(p.router.ptr),
                Arg::I32(t as i32),
                Arg::I32(e as i32),
                Arg::I32(h as i32),
                Arg::Ptr(p.logits.ptr),
            ],
        )?;
        Ok(())
    }

    /// Gate/up with SiLU·mul, then down with the combine into `p.out`, after routing filled the
    /// top-k ids and weights.
    pub fn experts(&self, s: CUstream, p: &MoeGemvExperts) -> anyhow::Result<()> {
        let (t, k, h, im, pieces) = (p.tokens, p.top_k, p.hidden, p.inter, p.shared_pieces);
        let ims = pieces * im;
        anyhow::ensure!(
            p.act.len >= t * k * im && p.act_shared.len >= t * ims && p.out.len >= t * h,
            "moe gemv: buffers too small"
        );
        anyhow::ensure!(k + pieces <= 32, "moe gemv: top_k {k} + {pieces} shared pieces exceed one warp per slot");
        let (sh_gu, sh_down) = match (pieces, p.shared) {
            (0, _) => (0, 0),
            (_, Some((gu, down))) => (gu.ptr, down.ptr),
            (_, None) => anyhow::bail!("moe gemv: {pieces} shared pieces without shared-expert weights"),
        };
        let items = t * k * im + if pieces > 0 { t * ims } else { 0 };
        // One wave of blocks whose warps stride over the items (no ragged last wave).
        self.gate_up.launch(
            s,
            (items.div_ceil(MOE_GEMV_WARPS).min(self.gate_up_wave) as u32, 1, 1),
            (32 * MOE_GEMV_WARPS) as u32,
            0,
            &[
                Arg::Ptr(p.x.ptr),
                Arg::I32(h as i32),
                Arg::I32(t as i32),
                Arg::Ptr(p.topk_ids.ptr),
                Arg::I32(k as i32),
                Arg::Ptr(p.gate_up.ptr),
                Arg::I32(im as i32),
                Arg::Ptr(sh_gu),
                Arg::I32(ims as i32),
                Arg::Ptr(p.act.ptr),
                Arg::Ptr(p.act_shared.ptr),
            ],
        )?;
        let down_threads = (32 * (k + pieces)) as u32;
        // Same for the down kernel; its block size is fixed per model, so ask once per size.
        let known = self.down_waves.borrow().iter().find(|(b, _)| *b == down_threads).map(|&(_, w)| w);
        let wave = match known {
            Some(w) => w,
            None => {
                let w = self.sm_count * self.down.max_active_blocks_per_sm(down_threads, 0)?;
                self.down_waves.borrow_mut().push((down_threads, w));
                w
            }
        };
        self.down.launch(
            s,
            ((h / 2).min(wave.div_ceil(t).max(1)) as u32, t as u32, 1),
            down_threads,
            0,
            &[
                Arg::Ptr(p.act.ptr),
                Arg::I32(im as i32),
                Arg::Ptr(p.down.ptr),
                Arg::Ptr(p.topk_ids.ptr),
                Arg::Ptr(p.topk_w.ptr),
                Arg::I32(k as i32),
                Arg::Ptr(p.act_shared.ptr),
                Arg::I32(ims as i32),
                Arg::Ptr(sh_down),
                Arg::I32(pieces as i32),
                Arg::Ptr(p.out.ptr),
                Arg::I32(h as i32),
            ],
        )?;
        Ok(())
    }
}
