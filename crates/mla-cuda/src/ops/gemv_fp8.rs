//! kernels/gemv_fp8.cu: `y = x · Wᵀ` for 1 to `FP8_GEMV_MAX_ROWS` rows on a block-FP8 weight
//! (e4m3 bytes with one f32 `scale_inv` per 128x128 block, DeepSeek-V3's checkpoint layout),
//! streaming the weight bytes and dequantizing in registers (W8A16), in three kernels: FMAs per
//! weight, bf16 tensor-core MMAs on the converted weights, and the streaming kernel (issue 29:
//! the MMAs fed from a per-lane cp.async ring, K split over a thread-block cluster on narrow
//! shapes); exact products in all. The decode-path kernel of issue 12's FP8 weights
//! (`model::small_linear`).

use super::count_knob;
use super::dims::{
    FP8_GEMV_MAX_ROWS, GEMV_FP8_STREAM_SMEM_W2T1S8, GEMV_FP8_STREAM_SMEM_W4T1S4, GEMV_FP8_STREAM_SMEM_W4T1S6,
    GEMV_FP8_STREAM_SMEM_W4T2S4, GEMV_FP8_STREAM_SMEM_W8T1S6, GEMV_FP8_STREAM_SMEM_W8T2S3, GEMV_KERNEL_MAX_ROWS,
    GEMV_ROWS_PER_BLOCK,
};
use super::gemv::GemvOut;
use super::linear::{Fp8Linear, Strided};
use crate::gpu::{Arg, GpuInfo, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;

/// Which FP8 GEMV kernel runs (tests and benchmarks run each; `launch` picks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8GemvKind {
    /// `gemv_fp8_block`: a warp streams 2 weight rows, FMAs per weight and input row.
    Fma,
    /// `gemv_fp8_mma`: a warp takes 16 weight rows, 8 warps split K, mma.sync m16n8k16.
    Mma,
    /// `gemv_fp8_stream_*`: `StreamConfig::choose`'s variant and split (sm_90 only; elsewhere
    /// `launch_with` runs the MMA kernel instead).
    Stream,
}

impl Fp8GemvKind {
    pub const ALL: [Fp8GemvKind; 3] = [Fp8GemvKind::Fma, Fp8GemvKind::Mma, Fp8GemvKind::Stream];
}

/// One compiled shape of the streaming kernel: warps per CTA, 16-row tiles per warp, ring stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamVariant {
    /// The kernel's name in kernels/gemv_fp8.cu.
    pub kernel: &'static str,
    pub warps: usize,
    pub tiles: usize,
    pub stages: usize,
    /// Dynamic shared memory (kernels/dims.cuh).
    pub smem: usize,
}

impl StreamVariant {
    /// Weight rows one CTA covers.
    pub fn cta_rows(&self) -> usize {
        16 * self.warps * self.tiles
    }

    pub fn name(&self) -> String {
        format!("w{}t{}s{}", self.warps, self.tiles, self.stages)
    }
}

/// The variants kernels/gemv_fp8.cu instantiates, in the order of `StreamConfig::variant`.
pub const STREAM_VARIANTS: [StreamVariant; 6] = [
    StreamVariant {
        kernel: "gemv_fp8_stream_w4t1s4",
        warps: 4,
        tiles: 1,
        stages: 4,
        smem: GEMV_FP8_STREAM_SMEM_W4T1S4,
    },
    StreamVariant {
        kernel: "gemv_fp8_stream_w4t2s4",
        warps: 4,
        tiles: 2,
        stages: 4,
        smem: GEMV_FP8_STREAM_SMEM_W4T2S4,
    },
    StreamVariant {
        kernel: "gemv_fp8_stream_w8t1s6",
        warps: 8,
        tiles: 1,
        stages: 6,
        smem: GEMV_FP8_STREAM_SMEM_W8T1S6,
    },
    StreamVariant {
        kernel: "gemv_fp8_stream_w2t1s8",
        warps: 2,
        tiles: 1,
        stages: 8,
        smem: GEMV_FP8_STREAM_SMEM_W2T1S8,
    },
    StreamVariant {
        kernel: "gemv_fp8_stream_w4t1s6",
        warps: 4,
        tiles: 1,
        stages: 6,
        smem: GEMV_FP8_STREAM_SMEM_W4T1S6,
    },
    StreamVariant {
        kernel: "gemv_fp8_stream_w8t2s3",
        warps: 8,
        tiles: 2,
        stages: 3,
        smem: GEMV_FP8_STREAM_SMEM_W8T2S3,
    },
];

/// How one launch of the streaming kernel runs: which variant, over how many K splits (the
/// cluster size, 1 to 8), with or without the L2 prefetch of each CTA's weights at its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamConfig {
    pub variant: usize,
    pub splits: usize,
    pub prefetch: bool,
}

/// `STREAM_VARIANTS` index of w4t1s4, the default, and of w4t2s4, past 4 rows on shapes it fills.
const STREAM_DEFAULT: usize = 0;
const STREAM_WIDE: usize = 1;

/// Most K splits (the portable cluster size).
pub const STREAM_MAX_SPLITS: usize = 8;

impl StreamConfig {
    /// The launch for an [n, k] weight and `rows` input rows on a GPU that holds `slots[v]` CTAs
    /// of variant v at once (SMs x CTAs per SM). From the H200 sweep G2 (docs/performance.md):
    /// what counts is one full wave. w4t1s4 (3 CTAs per SM), with K split into as many parts
    /// (at most 8) as keep the CTAs within one wave: o_proj's 112 row blocks x 3 splits took
    /// 33.2 us, x 4 (two waves) 43.3. When the rows alone fill a wave (dense gate/up), 2 splits
    /// if K has at least 32 scale blocks (shorter CTAs, a shorter last wave: 81.2 against 84.0
    /// us at 8 rows). Past 4 rows, w4t2s4 (32 rows a warp: half the input reads per weight)
    /// when it fills at least 80% of a wave (o_proj at 8 rows 35.6 against 39.9 us), else
    /// w4t1s4 (q_a+kv_a, q_b).
    pub fn choose(n: usize, k: usize, rows: usize, slots: &[usize]) -> StreamConfig {
        let k_blocks = k.div_ceil(super::linear::FP8_BLOCK).max(1);
        // (splits, fraction of a wave filled; > 1: several waves) of variant v.
        let plan = |v: usize| {
            let row_ctas = n.div_ceil(STREAM_VARIANTS[v].cta_rows()).max(1);
            let slots = slots[v].max(1);
            if row_ctas >= slots {
                let splits = if k_blocks >= 32 { 2 } else { 1 };
                return (Self::no_empty_split(k, splits), row_ctas as f64 / slots as f64);
            }
            let splits = (1..=STREAM_MAX_SPLITS.min(k_blocks))
                .filter(|&s| Self::no_empty_split(k, s) == s && row_ctas * s <= slots)
                .max()
                .unwrap_or(1);
            (splits, (row_ctas * splits) as f64 / slots as f64)
        };
        if rows > 4 {
            let (splits, fill) = plan(STREAM_WIDE);
            if (0.8..=1.0).contains(&fill) {
                return StreamConfig { variant: STREAM_WIDE, splits, prefetch: false };
            }
        }
        StreamConfig { variant: STREAM_DEFAULT, splits: plan(STREAM_DEFAULT).0, prefetch: false }
    }

    /// The number of non-empty splits when K's scale blocks are dealt out `ceil(blocks / splits)`
    /// at a time, as the kernel does.
    pub fn no_empty_split(k: usize, splits: usize) -> usize {
        let blocks = k.div_ceil(super::linear::FP8_BLOCK).max(1);
        let per = blocks.div_ceil(splits.clamp(1, blocks));
        blocks.div_ceil(per)
    }
}

pub struct GemvFp8Kernels {
    fma: Kernel,
    mma: Kernel,
    /// The streaming variants (`STREAM_VARIANTS` order); empty without the sm_90a cubin.
    stream: Vec<Kernel>,
    /// CTAs of each variant the GPU holds at once.
    stream_slots: Vec<usize>,
    /// Weights of fewer bytes than this keep the FMA / MMA kernels (`kind_for`).
    stream_min_bytes: usize,
}

/// Below this many weight bytes `kind_for` keeps the FMA / MMA kernels (see there). For A/B runs
/// `MLA_GEMV_STREAM_MIN_BYTES` overrides it at load (0: the streaming kernel for every shape).
pub const STREAM_MIN_BYTES: usize = 8 << 20;
/// Steps of more rows keep the MMA kernel (see `kind_for`).
pub const STREAM_MAX_ROWS: usize = 4;

impl GemvFp8Kernels {
    pub fn load(m: &Modules, info: &GpuInfo) -> anyhow::Result<Self> {
        let (mut stream, mut stream_slots) = (vec![], vec![]);
        // Clusters and the variants' shared memory: the sm_90a cubin only.
        if !m.used_ptx && STREAM_VARIANTS.iter().all(|v| v.smem <= info.max_smem_per_block_optin) {
            for v in STREAM_VARIANTS {
                let k = m.kernel("gemv_fp8", v.kernel)?;
                k.set_max_dynamic_smem(v.smem)?;
                stream_slots.push(info.sm_count * k.max_active_blocks_per_sm(32 * v.warps as u32, v.smem)?);
                stream.push(k);
            }
        }
        Ok(GemvFp8Kernels {
            fma: m.kernel("gemv_fp8", "gemv_fp8_block")?,
            mma: m.kernel("gemv_fp8", "gemv_fp8_mma")?,
            stream,
            stream_slots,
            stream_min_bytes: count_knob("MLA_GEMV_STREAM_MIN_BYTES", STREAM_MIN_BYTES)?,
        })
    }

    /// Whether the streaming kernel is loaded (sm_90).
    pub fn has_stream(&self) -> bool {
        !self.stream.is_empty()
    }

    /// `StreamConfig::choose` on this GPU.
    pub fn stream_config(&self, n: usize, k: usize, rows: usize) -> StreamConfig {
        StreamConfig::choose(n, k, rows, &self.stream_slots)
    }

    /// Whether `launch` can take these operands: K a multiple of 16 (16-byte weight loads), the
    /// input stride a multiple of 8, both 16-byte aligned, at most `FP8_GEMV_MAX_ROWS` rows
    /// (the FMA kernel: `GEMV_KERNEL_MAX_ROWS`), sizes that fit its int arguments.
    pub fn takes(lin: &Fp8Linear, x: &Strided<bf16>, rows: usize) -> bool {
        (1..=FP8_GEMV_MAX_ROWS).contains(&rows)
            && lin.inp.is_multiple_of(16)
            && x.stride.is_multiple_of(8)
            && x.data.ptr.is_multiple_of(16)
            && lin.w.ptr.is_multiple_of(16)
            && lin.out < i32::MAX as usize
            && lin.inp < i32::MAX as usize
    }

    pub fn launch(
        &self,
        s: CUstream,
        lin: &Fp8Linear,
        x: Strided<bf16>,
        rows: usize,
        y: GemvOut,
    ) -> anyhow::Result<()> {
        self.launch_with(self.kind_for(lin, rows), s, lin, x, rows, y)
    }

    /// The kernel for `rows` input rows of `lin`. The streaming one where it is loaded (sm_90)
    /// for weights of at least `STREAM_MIN_BYTES` and at most `STREAM_MAX_ROWS` rows. Alone (run
    /// G15, H200, docs/performance.md) it took V3's q_a+kv_a, q_b, o_proj and dense gate/up at 1
    /// row in 7.7 / 11.2 / 32.7 / 70.5 us against the FMA kernel's 10.1 / 16.7 / 56.6 / 83.6
    /// and the MMA kernel's 12.2 / 15.6 / 51.9 / 99.6, and stays ahead at 2 to 8 rows. In the
    /// engine (run B6, H200) it lost where the weights are small or the rows many: V2-Lite FP8
    /// decoded at 469 tok/s at B = 1 and 1,583-1,593 at B = 8 with it on every shape, against
    /// 508-510 and 1,692-1,703 without; at 8 MiB and up, 509-511 and 1,634-1,639; one TP-8 rank
    /// of V3 (61 layers) 140 tok/s at B = 1 from 8 MiB up against 135 without. The cause of the
    /// loss in the engine (the kernels around it, the cluster launch) is not profiled yet.
    /// Elsewhere (PTX): the FMA kernel at 1 row, the MMA one at 2 to 8 (run F17: at 4 rows
    /// 12.3 / 16.1 / 52.8 us on q_a+kv_a, q_b, o_proj against the FMA kernel's 20.0 / 27.7 /
    /// 159.3).
    pub fn kind_for(&self, lin: &Fp8Linear, rows: usize) -> Fp8GemvKind {
        if self.has_stream() && rows <= STREAM_MAX_ROWS && lin.out * lin.inp >= self.stream_min_bytes {
            Fp8GemvKind::Stream
        } else if rows == 1 {
            Fp8GemvKind::Fma
        } else {
            Fp8GemvKind::Mma
        }
    }

    /// `launch` with the kernel chosen.
    pub fn launch_with(
        &self,
        kind: Fp8GemvKind,
        s: CUstream,
        lin: &Fp8Linear,
        x: Strided<bf16>,
        rows: usize,
        y: GemvOut,
    ) -> anyhow::Result<()> {
        if kind == Fp8GemvKind::Stream {
            if self.has_stream() {
                return self.launch_stream(self.stream_config(lin.out, lin.inp, rows), s, lin, x, rows, y);
            }
            return self.launch_with(Fp8GemvKind::Mma, s, lin, x, rows, y);
        }
        self.check(lin, &x, rows, &y)?;
        anyhow::ensure!(
            kind == Fp8GemvKind::Mma || rows <= GEMV_KERNEL_MAX_ROWS,
            "gemv_fp8: the FMA kernel takes at most {GEMV_KERNEL_MAX_ROWS} rows, not {rows}"
        );
        let (kernel, blocks, threads) = match kind {
            Fp8GemvKind::Fma => (&self.fma, lin.out.div_ceil(GEMV_ROWS_PER_BLOCK), 128),
            _ => (&self.mma, lin.out.div_ceil(16), 256),
        };
        kernel.launch(s, (blocks as u32, 1, 1), threads, 0, &kernel_args(lin, &x, rows, &y))?;
        Ok(())
    }

    /// The streaming kernel with an explicit configuration (tests and benchmarks sweep them).
    pub fn launch_stream(
        &self,
        cfg: StreamConfig,
        s: CUstream,
        lin: &Fp8Linear,
        x: Strided<bf16>,
        rows: usize,
        y: GemvOut,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(self.has_stream(), "gemv_fp8: the streaming kernel needs the sm_90a cubin");
        let v = STREAM_VARIANTS.get(cfg.variant).ok_or_else(|| anyhow::anyhow!("no stream variant {}", cfg.variant))?;
        anyhow::ensure!(
            (1..=STREAM_MAX_SPLITS).contains(&cfg.splits),
            "gemv_fp8: {} K splits (1 to {STREAM_MAX_SPLITS})",
            cfg.splits
        );
        self.check(lin, &x, rows, &y)?;
        self.stream[cfg.variant].launch_cluster(
            s,
            (cfg.splits as u32, lin.out.div_ceil(v.cta_rows()) as u32, 1),
            32 * v.warps as u32,
            v.smem as u32,
            cfg.splits as u32,
            &[&kernel_args(lin, &x, rows, &y)[..], &[Arg::I32(cfg.prefetch as i32)]].concat(),
        )?;
        Ok(())
    }

    /// The operand checks every kernel shares.
    fn check(&self, lin: &Fp8Linear, x: &Strided<bf16>, rows: usize, y: &GemvOut) -> anyhow::Result<()> {
        anyhow::ensure!(Self::takes(lin, x, rows), "gemv_fp8: operands the kernel cannot take ({rows} rows)");
        lin.check("gemv_fp8")?;
        let need = x.need(rows, lin.inp);
        anyhow::ensure!(x.data.len >= need, "gemv_fp8 input: {} elements, {need} needed", x.data.len);
        let (_, len, stride) = y.ptr_len_stride();
        anyhow::ensure!(stride >= lin.out, "gemv_fp8 output stride {stride} < {}", lin.out);
        anyhow::ensure!(len >= (rows - 1) * stride + lin.out, "gemv_fp8 output: {len} elements too few");
        Ok(())
    }
}

/// The arguments every FP8 GEMV kernel takes, in order (the streaming one adds its prefetch flag).
fn kernel_args(lin: &Fp8Linear, x: &Strided<bf16>, rows: usize, y: &GemvOut) -> [Arg; 10] {
    let (ptr, _, stride) = y.ptr_len_stride();
    [
        Arg::Ptr(lin.w.ptr),
        Arg::Ptr(lin.scale_inv.ptr),
        Arg::I32(lin.out as i32),
        Arg::I32(lin.inp as i32),
        Arg::Ptr(x.data.ptr),
        Arg::I32(x.stride as i32),
        Arg::I32(rows as i32),
        Arg::Ptr(ptr),
        Arg::I32(stride as i32),
        Arg::I32(y.is_f32() as i32),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configurations `choose` gives V3's shapes on an H100/H200 (132 SMs: 396 CTAs of
    /// w4t1s4, 264 of w4t2s4), as the G2 sweep found best.
    #[test]
    fn choose_fills_one_wave() {
        let slots = [396, 264, 132, 396, 264, 132];
        let pick = |n, k, rows| {
            let c = StreamConfig::choose(n, k, rows, &slots);
            (STREAM_VARIANTS[c.variant].name(), c.splits)
        };
        let t1 = |s| ("w4t1s4".to_string(), s);
        let t2 = |s| ("w4t2s4".to_string(), s);
        for rows in [1, 4] {
            assert_eq!(pick(2112, 7168, rows), t1(8), "q_a+kv_a");
            assert_eq!(pick(24576, 1536, rows), t1(1), "q_b");
            assert_eq!(pick(7168, 16384, rows), t1(3), "o_proj");
            assert_eq!(pick(7168, 18432, rows), t1(3), "dense down");
            assert_eq!(pick(36864, 7168, rows), t1(2), "dense gate/up");
        }
        assert_eq!(pick(2112, 7168, 8), t1(8));
        assert_eq!(pick(24576, 1536, 8), t1(1));
        assert_eq!(pick(7168, 16384, 8), t2(4));
        assert_eq!(pick(7168, 18432, 8), t2(4));
        assert_eq!(pick(36864, 7168, 8), t1(2));
        // Tiny and odd shapes: no empty split, at least one.
        assert_eq!(pick(13, 48, 1), t1(1));
        assert_eq!(pick(384, 1360, 1), t1(6));
    }
}
