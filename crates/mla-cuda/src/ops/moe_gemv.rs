//! kernels/moe_gemv.cu: DeepSeekMoE for steps of a few tokens as weight-streaming GEMVs: the
//! router, gate/up with SiLU·mul, and down with the weighted combine, routed and shared experts in
//! the same launches, on bf16 or block-FP8 expert weights. When the model takes this path is
//! `model::moe_small`'s decision.

use super::count_knob;
use super::dims::{MOE_GATE_UP_STREAM_SMEM, MOE_GATE_UP_STREAM_WARPS, MOE_GEMV_WARPS};
use super::expert_mats::ExpertMats;
use super::gemv_fp8::StreamConfig;
use super::linear::FP8_BLOCK;
use crate::gpu::{Arg, DSlice, GpuInfo, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;
use std::cell::RefCell;

pub struct MoeGemvKernels {
    router: Kernel,
    gate_up: Kernel,
    down: Kernel,
    /// The same two on block-FP8 expert weights.
    gate_up_fp8: Kernel,
    /// `gate_up_fp8` held to five blocks an SM (`GateUpKernel::WarpFiveBlocks`).
    gate_up_fp8_5b: Kernel,
    /// Where `experts` takes it instead of the warp kernel (`MLA_MOE_GATE_UP_5B` for A/B runs).
    five_blocks: VariantPolicy,
    /// kernels/moe_gate_up_stream.cu (sm_90a cubin only) and the CTAs the GPU holds at once.
    gate_up_fp8_stream: Option<(Kernel, usize)>,
    /// When `experts` takes the streaming FP8 gate/up (`MLA_MOE_GATE_UP_STREAM` for A/B runs).
    stream_policy: VariantPolicy,
    down_fp8: Kernel,
    /// `down_fp8` for experts of at most `NARROW_DOWN_MAX_INTER` columns (`DownKernel::choose`).
    down_fp8_narrow: Kernel,
    /// Blocks of the gate/up kernel that fit on the GPU at once (its grid is one wave).
    gate_up_wave: usize,
    gate_up_fp8_wave: usize,
    gate_up_fp8_5b_wave: usize,
    /// The same for the down kernels by kernel (`DownKernel`) and block size, which depends on
    /// the model (asked at first use).
    down_waves: RefCell<Vec<(DownKernel, u32, usize)>>,
    sm_count: usize,
    /// Most tokens a step may have for these kernels (`MOE_GEMV_MAX_TOKENS`, or
    /// `MLA_MOE_GEMV_MAX_TOKENS` for A/B runs).
    max_tokens: usize,
    /// Most tokens the router GEMV takes (`ROUTER_GEMV_MAX_TOKENS`, or
    /// `MLA_MOE_ROUTER_GEMV_MAX_TOKENS` for A/B runs).
    router_max_tokens: usize,
}

/// Most tokens a step may have for this path. Each routed slot reads its expert's weights, so
/// past a few tokens (experts shared between tokens) the grouped GEMMs read less: at 8 tokens they
/// won (run S35: V2-Lite FP8 decode at B = 8, 1,731 tok/s grouped against 1,270 here).
pub const MOE_GEMV_MAX_TOKENS: usize = 4;

/// Most tokens of a step whose router logits come from `moe_router_gemv` rather than an f32
/// cuBLAS GEMM, on either MoE path (the small-step path's steps are fewer). At 8 tokens on a TP-8 rank of V3 cuBLAS split K in two kernels
/// (12.2 + 18.2 us under ncu, and 2.3 us to widen the inputs to f32) where the GEMV takes 12.5
/// (run S48). The GEMV also sums in the same order at every batch size, so a verify step routes
/// its rows with the bits a plain step would.
pub const ROUTER_GEMV_MAX_TOKENS: usize = 16;

/// The widest experts (columns of the down projection) the narrow FP8 down kernel takes: one
/// 16-byte chunk of a row per lane.
pub const NARROW_DOWN_MAX_INTER: usize = 32 * 16;
/// Output rows the narrow kernel takes per round (kernels/moe_gemv.cu `DOWN_ROWS`).
const NARROW_DOWN_ROWS: usize = 8;

/// The gate/up kernels on block-FP8 experts.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum GateUpKernel {
    /// moe_gemv_gate_up_fp8: a warp per (slot, column), every GPU.
    Warp,
    /// moe_gemv_gate_up_fp8_5b: the same held to five blocks an SM (96 registers), so more
    /// warps are resident (the same bits).
    WarpFiveBlocks,
    /// moe_gate_up_fp8_stream: MMA tiles fed by cp.async rings, K split over a cluster (sm_90a).
    Stream,
}

/// When a gate/up variant runs, as its A/B knob says: 0 never, 1 where it measured faster (the
/// default), 2 always. `MLA_MOE_GATE_UP_STREAM` for the streaming kernel (where the cubin has
/// it), `MLA_MOE_GATE_UP_5B` for the five-block warp kernel.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum VariantPolicy {
    Never,
    Measured,
    Always,
}

impl VariantPolicy {
    fn from_knob(name: &str) -> anyhow::Result<Self> {
        Ok(match count_knob(name, 1)? {
            0 => VariantPolicy::Never,
            1 => VariantPolicy::Measured,
            2 => VariantPolicy::Always,
            n => anyhow::bail!("{name}={n}: 0 (never), 1 (where it measured faster) or 2 (always)"),
        })
    }

    /// Whether the variant runs where `measured_faster` says whether it measured faster.
    fn runs(self, measured_faster: bool) -> bool {
        match self {
            VariantPolicy::Never => false,
            VariantPolicy::Measured => measured_faster,
            VariantPolicy::Always => true,
        }
    }
}

/// Under `VariantPolicy::Measured` the streaming gate/up takes a step when its grid has at least
/// this many CTAs per SM at one K split, on experts at least `STREAM_MIN_K_BLOCKS` scale blocks
/// deep (the hidden size / 128). Each CTA keeps 3 stages of 8 KB in flight and pays a fixed
/// start (the programmatic-launch wait, the expert id, filling its ring) and end (the split-K
/// sums): fewer CTAs than SMs x 2 leave SMs with less in flight or less work than others, and
/// short rows leave the fixed costs unpaid. Measured (H200, runs S42-S44), plain decode ms:
/// - TP-8 rank of V3 (K = 56 blocks, 132 SMs): lost at 1-3 tokens (72-200 CTAs; 5.37 against
///   5.32 at B = 1, 6.76 against 6.51 at 2, 7.87 against 7.52 at 3, the best split each), won
///   at 4 (264 CTAs: 8.42 against 8.82).
/// - V2-Lite (K = 16 blocks): lost at every batch although its grid is 352 CTAs at B = 1
///   (1.94-1.96 against 1.90-1.93 at B = 1, 2.74-2.77 against 2.58-2.61 at 2, 3.85 against
///   3.77-3.80 at 4).
const STREAM_MIN_CTAS_PER_SM: usize = 2;
const STREAM_MIN_K_BLOCKS: usize = 32;

/// The FP8 gate/up kernel for a step of `tokens` whose streaming grid has `ctas` CTAs at one
/// split, over `hidden` columns, on `sm_count` SMs, the streaming kernel run as `stream` says.
fn stream_or_warp(stream: VariantPolicy, tokens: usize, ctas: usize, hidden: usize, sm_count: usize) -> GateUpKernel {
    let faster = ctas >= sm_count * STREAM_MIN_CTAS_PER_SM && hidden.div_ceil(FP8_BLOCK) >= STREAM_MIN_K_BLOCKS;
    if tokens <= STREAM_MAX_TOKENS && stream.runs(faster) {
        GateUpKernel::Stream
    } else {
        GateUpKernel::Warp
    }
}

/// Rows this many 128-wide scale blocks deep or more take the five-block warp kernel under
/// `VariantPolicy::Measured`. Measured on an H200 (run S56, plain decode ms, two runs each):
/// a TP-8 rank of V3 (rows of 56 blocks) 5.267 / 5.262 -> 5.167 / 5.156 at B = 1, 6.472 / 6.482
/// -> 6.374 / 6.355 at 2, 7.446 / 7.426 -> 7.346 / 7.330 at 3; V2-Lite (16 blocks, many short
/// items a warp) 548 / 547 -> 541 / 543 tok/s at B = 1, even at 2 and 4.
const FIVE_BLOCKS_MIN_K_BLOCKS: usize = 32;

/// The FP8 warp gate/up kernel for rows of `hidden` columns, the five-block one run as
/// `five_blocks` says.
fn warp_kernel(five_blocks: VariantPolicy, hidden: usize) -> GateUpKernel {
    if five_blocks.runs(hidden.div_ceil(FP8_BLOCK) >= FIVE_BLOCKS_MIN_K_BLOCKS) {
        GateUpKernel::WarpFiveBlocks
    } else {
        GateUpKernel::Warp
    }
}

/// Most K splits of the streaming gate/up: at B = 1 on a TP-8 rank of V3, 3 or 4 splits took
/// 19.7-20.0 us under ncu, 5 (the most one wave holds) 23.8 (run S42).
const STREAM_GATE_UP_MAX_SPLITS: usize = 4;

/// The streaming gate/up's columns per CTA (8 a warp).
const STREAM_CTA_COLS: usize = 8 * MOE_GATE_UP_STREAM_WARPS;
/// Most tokens the streaming gate/up multiplies at once (the MMA's 8 columns).
const STREAM_MAX_TOKENS: usize = 8;

/// Which down kernel a step takes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum DownKernel {
    Bf16,
    Fp8,
    /// FP8 experts of at most `NARROW_DOWN_MAX_INTER` columns, `NARROW_DOWN_ROWS` output rows a
    /// round (run S33: the row-pair kernel read a TP-8 rank of V3's down weights at 0.6 TB/s).
    Fp8Narrow,
}

impl DownKernel {
    fn choose(fp8: bool, inter: usize, hidden: usize) -> Self {
        match fp8 {
            false => DownKernel::Bf16,
            true if inter <= NARROW_DOWN_MAX_INTER && hidden.is_multiple_of(NARROW_DOWN_ROWS) => DownKernel::Fp8Narrow,
            true => DownKernel::Fp8,
        }
    }

    /// Output rows a block takes per round.
    fn rows(self) -> usize {
        match self {
            DownKernel::Fp8Narrow => NARROW_DOWN_ROWS,
            _ => 2,
        }
    }
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
    pub gate_up: ExpertMats<'a>,
    pub down: ExpertMats<'a>,
    /// The shared experts' `[2·Is, hidden]` and `[hidden, Is]` (one expert each), when
    /// `shared_pieces > 0`; in the routed experts' format.
    pub shared: Option<(ExpertMats<'a>, ExpertMats<'a>)>,
    /// `[tokens · top_k, inter]` and `[tokens, Is]` scratch.
    pub act: DSlice<'a, bf16>,
    pub act_shared: DSlice<'a, bf16>,
    pub out: DSlice<'a, bf16>,
}

impl MoeGemvKernels {
    pub fn load(m: &Modules, info: &GpuInfo) -> anyhow::Result<Self> {
        let k = |name| m.kernel("moe_gemv", name);
        let gate_up = k("moe_gemv_gate_up")?;
        let gate_up_fp8 = k("moe_gemv_gate_up_fp8")?;
        let gate_up_fp8_5b = k("moe_gemv_gate_up_fp8_5b")?;
        let threads = (32 * MOE_GEMV_WARPS) as u32;
        // Clusters and 70 KB of shared memory: the sm_90a cubin only.
        let gate_up_fp8_stream = if !m.used_ptx && MOE_GATE_UP_STREAM_SMEM <= info.max_smem_per_block_optin {
            let kernel = m.kernel("moe_gate_up_stream", "moe_gate_up_fp8_stream")?;
            kernel.set_max_dynamic_smem(MOE_GATE_UP_STREAM_SMEM)?;
            let threads = (32 * MOE_GATE_UP_STREAM_WARPS) as u32;
            let slots = info.sm_count * kernel.max_active_blocks_per_sm(threads, MOE_GATE_UP_STREAM_SMEM)?;
            Some((kernel, slots))
        } else {
            None
        };
        let stream_policy = match VariantPolicy::from_knob("MLA_MOE_GATE_UP_STREAM")? {
            _ if gate_up_fp8_stream.is_none() => VariantPolicy::Never,
            p => p,
        };
        Ok(MoeGemvKernels {
            gate_up_fp8_stream,
            stream_policy,
            router: k("moe_router_gemv")?,
            gate_up_wave: info.sm_count * gate_up.max_active_blocks_per_sm(threads, 0)?,
            gate_up_fp8_wave: info.sm_count * gate_up_fp8.max_active_blocks_per_sm(threads, 0)?,
            gate_up_fp8_5b_wave: info.sm_count * gate_up_fp8_5b.max_active_blocks_per_sm(threads, 0)?,
            gate_up_fp8_5b,
            five_blocks: VariantPolicy::from_knob("MLA_MOE_GATE_UP_5B")?,
            gate_up,
            down: k("moe_gemv_down")?,
            gate_up_fp8,
            down_fp8: k("moe_gemv_down_fp8")?,
            down_fp8_narrow: k("moe_gemv_down_fp8_narrow")?,
            down_waves: RefCell::default(),
            sm_count: info.sm_count,
            max_tokens: count_knob("MLA_MOE_GEMV_MAX_TOKENS", MOE_GEMV_MAX_TOKENS)?,
            router_max_tokens: count_knob("MLA_MOE_ROUTER_GEMV_MAX_TOKENS", ROUTER_GEMV_MAX_TOKENS)?,
        })
    }

    /// Most tokens a step may have for these kernels (`model::moe_small::takes`).
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Whether the router GEMV computes the logits of a step of `tokens` tokens (hidden % (4
    /// warps) == 0 as the kernel needs); else cuBLAS does.
    pub fn routes(&self, tokens: usize, hidden: usize) -> bool {
        tokens <= self.router_max_tokens && hidden.is_multiple_of(4 * MOE_GEMV_WARPS)
    }

    pub fn router(&self, s: CUstream, p: &MoeGemvRouter) -> anyhow::Result<()> {
        let (t, e, h) = (p.tokens, p.experts, p.hidden);
        anyhow::ensure!(
            p.x.len >= t * h && p.logits.len >= t * e && p.router.len >= e * h,
            "moe router: buffers too small"
        );
        anyhow::ensure!(
            h.is_multiple_of(4 * MOE_GEMV_WARPS),
            "moe router: hidden {h} is not a multiple of {}",
            4 * MOE_GEMV_WARPS
        );
        // One block per (token, expert), its warps splitting the row (kernels/moe_gemv.cu).
        self.router.launch(
            s,
            ((t * e) as u32, 1, 1),
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
    /// top-k ids and weights. Routed and shared experts must share a format; block-FP8 needs
    /// `hidden % 16 == 0` and `inter % 128 == 0` (the fused gate/up grids then stack exactly).
    pub fn experts(&self, s: CUstream, p: &MoeGemvExperts) -> anyhow::Result<()> {
        let kernel = match stream_or_warp(self.stream_policy, p.tokens, Self::stream_ctas(p), p.hidden, self.sm_count) {
            GateUpKernel::Warp => warp_kernel(self.five_blocks, p.hidden),
            k => k,
        };
        self.experts_with(s, p, kernel)
    }

    /// CTAs of the streaming gate/up at one K split: the routed slots' and the shared experts'
    /// column ranges.
    fn stream_ctas(p: &MoeGemvExperts) -> usize {
        (p.tokens * p.top_k * p.inter + p.shared_pieces * p.inter) / STREAM_CTA_COLS
    }

    /// `experts` with a chosen gate/up kernel for block-FP8 experts (bf16 experts have one);
    /// tests and benchmarks compare the two.
    pub fn experts_with(&self, s: CUstream, p: &MoeGemvExperts, fp8_gate_up: GateUpKernel) -> anyhow::Result<()> {
        let (t, k, h, im, pieces) = (p.tokens, p.top_k, p.hidden, p.inter, p.shared_pieces);
        let ims = pieces * im;
        anyhow::ensure!(
            p.act.len >= t * k * im && p.act_shared.len >= t * ims && p.out.len >= t * h,
            "moe gemv: buffers too small"
        );
        anyhow::ensure!(k + pieces <= 32, "moe gemv: top_k {k} + {pieces} shared pieces exceed one warp per slot");
        let shared = match (pieces, p.shared) {
            (0, _) => None,
            (_, Some(sh)) => Some(sh),
            (_, None) => anyhow::bail!("moe gemv: {pieces} shared pieces without shared-expert weights"),
        };
        let fp8 = p.gate_up.is_fp8();
        anyhow::ensure!(
            p.down.is_fp8() == fp8 && shared.is_none_or(|(gu, d)| gu.is_fp8() == fp8 && d.is_fp8() == fp8),
            "moe gemv: the routed and shared experts' gate/up and down weights must all be bf16 or all block-FP8"
        );
        if fp8 {
            anyhow::ensure!(
                h.is_multiple_of(16) && im.is_multiple_of(FP8_BLOCK),
                "moe gemv on block-FP8 experts needs hidden % 16 == 0 and inter % {FP8_BLOCK} == 0, got {h} and {im}"
            );
        }
        // Each matrix's kernel arguments: its pointer, then its scales' for FP8.
        let experts = p.gate_up.count(2 * im, h);
        anyhow::ensure!(experts > 0, "moe gemv: no routed experts' weights");
        let gate_up = p.gate_up.args("routed gate/up weights", experts, 2 * im, h)?;
        let down = p.down.args("routed down weights", experts, h, im)?;
        let (sh_gate_up, sh_down) = match shared {
            Some((gu, d)) => {
                (gu.args("shared gate/up weights", 1, 2 * ims, h)?, d.args("shared down weights", 1, h, ims)?)
            }
            None => (ExpertMats::null_args(fp8), ExpertMats::null_args(fp8)),
        };
        let mut args = vec![
            Arg::Ptr(p.x.ptr),
            Arg::I32(h as i32),
            Arg::I32(t as i32),
            Arg::Ptr(p.topk_ids.ptr),
            Arg::I32(k as i32),
        ];
        args.extend(gate_up);
        args.push(Arg::I32(im as i32));
        args.extend(sh_gate_up);
        args.extend([Arg::I32(ims as i32), Arg::Ptr(p.act.ptr), Arg::Ptr(p.act_shared.ptr)]);
        if fp8 && fp8_gate_up == GateUpKernel::Stream {
            self.gate_up_stream(s, p, &args)?;
        } else {
            let items = t * k * im + if pieces > 0 { t * ims } else { 0 };
            // One wave of blocks whose warps stride over the items (no ragged last wave).
            let (kernel, wave) = match (fp8, fp8_gate_up) {
                (false, _) => (&self.gate_up, self.gate_up_wave),
                (true, GateUpKernel::WarpFiveBlocks) => (&self.gate_up_fp8_5b, self.gate_up_fp8_5b_wave),
                (true, _) => (&self.gate_up_fp8, self.gate_up_fp8_wave),
            };
            kernel.launch(
                s,
                (items.div_ceil(MOE_GEMV_WARPS).min(wave) as u32, 1, 1),
                (32 * MOE_GEMV_WARPS) as u32,
                0,
                &args,
            )?;
        }
        let which = DownKernel::choose(fp8, im, h);
        let kernel = match which {
            DownKernel::Bf16 => &self.down,
            DownKernel::Fp8 => &self.down_fp8,
            DownKernel::Fp8Narrow => &self.down_fp8_narrow,
        };
        let down_threads = (32 * (k + pieces)) as u32;
        // Same for the down kernel; its block size is fixed per model, so ask once per size.
        let known = self.down_waves.borrow().iter().find(|&&(d, b, _)| d == which && b == down_threads).map(|x| x.2);
        let wave = match known {
            Some(w) => w,
            None => {
                let w = self.sm_count * kernel.max_active_blocks_per_sm(down_threads, 0)?;
                self.down_waves.borrow_mut().push((which, down_threads, w));
                w
            }
        };
        let mut args = vec![Arg::Ptr(p.act.ptr), Arg::I32(im as i32)];
        args.extend(down);
        args.extend([
            Arg::Ptr(p.topk_ids.ptr),
            Arg::Ptr(p.topk_w.ptr),
            Arg::I32(k as i32),
            Arg::Ptr(p.act_shared.ptr),
            Arg::I32(ims as i32),
        ]);
        args.extend(sh_down);
        args.extend([Arg::I32(pieces as i32), Arg::Ptr(p.out.ptr), Arg::I32(h as i32)]);
        let blocks = (h / which.rows()).min(wave.div_ceil(t).max(1));
        kernel.launch(s, (blocks as u32, t as u32, 1), down_threads, 0, &args)?;
        Ok(())
    }

    /// moe_gate_up_fp8_stream over the slots' and shared experts' column ranges, K split as far
    /// as one wave of CTAs allows, up to `STREAM_GATE_UP_MAX_SPLITS`
    /// (`StreamConfig::no_empty_split`: every split gets K blocks).
    /// `args` are the warp kernel's, which it shares.
    fn gate_up_stream(&self, s: CUstream, p: &MoeGemvExperts, args: &[Arg]) -> anyhow::Result<()> {
        let (tokens, hidden, inter, shared_inter) = (p.tokens, p.hidden, p.inter, p.shared_pieces * p.inter);
        let Some((kernel, slots)) = &self.gate_up_fp8_stream else {
            anyhow::bail!("moe gemv: the streaming gate/up needs the sm_90a cubin");
        };
        anyhow::ensure!(
            tokens <= STREAM_MAX_TOKENS
                && inter.is_multiple_of(STREAM_CTA_COLS)
                && shared_inter.is_multiple_of(STREAM_CTA_COLS),
            "moe gemv: the streaming gate/up takes at most {STREAM_MAX_TOKENS} tokens and widths in multiples \
             of {STREAM_CTA_COLS}, got {tokens}, {inter} and {shared_inter}"
        );
        let ctas = Self::stream_ctas(p);
        let splits = (1..=STREAM_GATE_UP_MAX_SPLITS)
            .filter(|&n| StreamConfig::no_empty_split(hidden, n) == n && ctas * n <= *slots)
            .max()
            .unwrap_or(1);
        kernel.launch_cluster(
            s,
            (splits as u32, ctas as u32, 1),
            (32 * MOE_GATE_UP_STREAM_WARPS) as u32,
            MOE_GATE_UP_STREAM_SMEM as u32,
            splits as u32,
            args,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_streaming_gate_up_takes_the_steps_it_measured_faster_on() {
        // A TP-8 rank of V3 on 132 SMs: 8 slots of 256 columns a token and one shared expert,
        // 32 columns a CTA (S42-S43: the warp kernel at 1-3 tokens, the stream at 4).
        let ctas = |tokens: usize| (tokens * 8 * 256 + 256) / STREAM_CTA_COLS;
        let pick = |policy: VariantPolicy, tokens| stream_or_warp(policy, tokens, ctas(tokens), 7168, 132);
        assert_eq!([1, 2, 3].map(|t| pick(VariantPolicy::Measured, t)), [GateUpKernel::Warp; 3]);
        assert_eq!(pick(VariantPolicy::Measured, 4), GateUpKernel::Stream);
        // V2-Lite (hidden 2048, 6 slots of 1,408 columns and two shared): the warp kernel at
        // every batch (S44).
        let v2_lite = |tokens: usize| (tokens * 6 + 2) * 1408 / STREAM_CTA_COLS;
        for t in [1, 2, 4] {
            assert_eq!(stream_or_warp(VariantPolicy::Measured, t, v2_lite(t), 2048, 132), GateUpKernel::Warp);
        }
        assert_eq!(pick(VariantPolicy::Always, 1), GateUpKernel::Stream);
        assert_eq!(pick(VariantPolicy::Never, 4), GateUpKernel::Warp);
        // Past the MMA's 8 token columns every policy keeps the warp kernel.
        assert_eq!(pick(VariantPolicy::Always, STREAM_MAX_TOKENS + 1), GateUpKernel::Warp);
    }

    #[test]
    fn the_five_block_warp_kernel_takes_the_deep_rows_it_measured_faster_on() {
        // V3's hidden 7168 (56 scale blocks): five blocks; V2-Lite's 2048 (16): four (run S56).
        assert_eq!(warp_kernel(VariantPolicy::Measured, 7168), GateUpKernel::WarpFiveBlocks);
        assert_eq!(warp_kernel(VariantPolicy::Measured, 2048), GateUpKernel::Warp);
        assert_eq!(warp_kernel(VariantPolicy::Always, 2048), GateUpKernel::WarpFiveBlocks);
        assert_eq!(warp_kernel(VariantPolicy::Never, 7168), GateUpKernel::Warp);
    }
}
