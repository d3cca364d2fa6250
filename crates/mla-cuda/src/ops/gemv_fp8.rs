//! kernels/gemv_fp8.cu: `y = x · Wᵀ` for 1 to `FP8_GEMV_MAX_ROWS` rows on a block-FP8 weight
//! (e4m3 bytes with one f32 `scale_inv` per 128x128 block, DeepSeek-V3's checkpoint layout),
//! streaming the weight bytes and dequantizing in registers (W8A16), in three kernels: FMAs per
//! weight, bf16 tensor-core MMAs on the converted weights, and the streaming kernel (issue 29:
//! the MMAs fed from a per-lane cp.async ring, K split over a thread-block cluster on narrow
//! shapes); exact products in all. The decode-path kernel of issue 12's FP8 weights
//! (`model::small_linear`).

use super::dims::{
    FP8_GEMV_MAX_ROWS, GEMV_FP8_STREAM_SMEM_W2T1S8, GEMV_FP8_STREAM_SMEM_W4T1S4, GEMV_FP8_STREAM_SMEM_W4T2S4,
    GEMV_FP8_STREAM_SMEM_W8T1S6, GEMV_FP8_STREAM_SMEM_W4T1S6, GEMV_FP8_STREAM_SMEM_W8T2S3, GEMV_KERNEL_MAX_ROWS, GEMV_ROWS_PER_BLOCK,
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
    StreamVariant { kernel: "gemv_fp8_stream_w4t1s4", warps: 4, tiles: 1, stages: 4, smem: GEMV_FP8_STREAM_SMEM_W4T1S4 },
    StreamVariant { kernel: "gemv_fp8_stream_w4t2s4", warps: 4, tiles: 2, stages: 4, smem: GEMV_FP8_STREAM_SMEM_W4T2S4 },
    StreamVariant { kernel: "gemv_fp8_stream_w8t1s6", warps: 8, tiles: 1, stages: 6, smem: GEMV_FP8_STREAM_SMEM_W8T1S6 },
    StreamVariant { kernel: "gemv_fp8_stream_w2t1s8", warps: 2, tiles: 1, stages: 8, smem: GEMV_FP8_STREAM_SMEM_W2T1S8 },
    StreamVariant { kernel: "gemv_fp8_stream_w4t1s6", warps: 4, tiles: 1, stages: 6, smem: GEMV_FP8_STREAM_SMEM_W4T1S6 },
    StreamVariant { kernel: "gemv_fp8_stream_w8t2s3", warps: 8, tiles: 2, stages: 3, smem: GEMV_FP8_STREAM_SMEM_W8T2S3 },
];

/// How one launch of the streaming kernel runs: which variant, over how many K splits (the
/// cluster size, 1 to 8), with or without the L2 prefetch of each CTA's weights at its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamConfig {
    pub variant: usize,
    pub splits: usize,
    pub prefetch: bool,
}

/// Most K splits (the portable cluster size).
pub const STREAM_MAX_SPLITS: usize = 8;

impl StreamConfig {
    /// The launch for an [n, k] weight on `sm_count` SMs: variant 0, and K split until the
    /// CTAs cover the SMs about twice (no split left empty).
    pub fn choose(n: usize, k: usize, sm_count: usize) -> StreamConfig {
        let variant = 0;
        let row_ctas = n.div_ceil(STREAM_VARIANTS[variant].cta_rows()).max(1);
        let splits = (2 * sm_count).div_ceil(row_ctas).clamp(1, STREAM_MAX_SPLITS);
        StreamConfig { variant, splits: Self::no_empty_split(k, splits), prefetch: false }
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
    sm_count: usize,
}

impl GemvFp8Kernels {
    pub fn load(m: &Modules, info: &GpuInfo) -> anyhow::Result<Self> {
        let mut stream = vec![];
        // Clusters and the variants' shared memory: the sm_90a cubin only.
        if !m.used_ptx && STREAM_VARIANTS.iter().all(|v| v.smem <= info.max_smem_per_block_optin) {
            for v in STREAM_VARIANTS {
                let k = m.kernel("gemv_fp8", v.kernel)?;
                k.set_max_dynamic_smem(v.smem)?;
                stream.push(k);
            }
        }
        Ok(GemvFp8Kernels {
            fma: m.kernel("gemv_fp8", "gemv_fp8_block")?,
            mma: m.kernel("gemv_fp8", "gemv_fp8_mma")?,
            stream,
            sm_count: info.sm_count,
        })
    }

    /// Whether the streaming kernel is loaded (sm_90).
    pub fn has_stream(&self) -> bool {
        !self.stream.is_empty()
    }

    /// `StreamConfig::choose` on this GPU.
    pub fn stream_config(&self, n: usize, k: usize) -> StreamConfig {
        StreamConfig::choose(n, k, self.sm_count)
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
        self.launch_with(Self::kind_for(rows), s, lin, x, rows, y)
    }

    /// The kernel for `rows` input rows (H200, run F17 in docs/runs/2026-11-26.md): at 4 rows
    /// the MMA kernel takes 12.3 / 16.1 / 52.8 / 58.4 us on V3's q_a+kv_a, q_b, o_proj and
    /// dense down against 20.0 / 27.7 / 159.3 / 203.6 for the FMA one (which spends an FMA per
    /// weight and row), and the same at 1 row as at 4; at 1 row the FMA kernel is as fast or
    /// faster on the shapes where the MMA one has the fewest warps per row (q_a+kv_a 10.1
    /// against 12.2 us, dense gate/up 83.4 against 100.1).
    pub fn kind_for(rows: usize) -> Fp8GemvKind {
        if rows == 1 {
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
                return self.launch_stream(self.stream_config(lin.out, lin.inp), s, lin, x, rows, y);
            }
            return self.launch_with(Fp8GemvKind::Mma, s, lin, x, rows, y);
        }
        self.check(lin, &x, rows, &y)?;
        anyhow::ensure!(
            kind == Fp8GemvKind::Mma || rows <= GEMV_KERNEL_MAX_ROWS,
            "gemv_fp8: the FMA kernel takes at most {GEMV_KERNEL_MAX_ROWS} rows, not {rows}"
        );
        let (ptr, _, stride) = y.ptr_len_stride();
        let (kernel, blocks, threads) = match kind {
            Fp8GemvKind::Fma => (&self.fma, lin.out.div_ceil(GEMV_ROWS_PER_BLOCK), 128),
            _ => (&self.mma, lin.out.div_ceil(16), 256),
        };
        kernel.launch(
            s,
            (blocks as u32, 1, 1),
            threads,
            0,
            &[
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
            ],
        )?;
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
        let (ptr, _, stride) = y.ptr_len_stride();
        self.stream[cfg.variant].launch_cluster(
            s,
            (cfg.splits as u32, lin.out.div_ceil(v.cta_rows()) as u32, 1),
            32 * v.warps as u32,
            v.smem as u32,
            cfg.splits as u32,
            &[
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
                Arg::I32(cfg.prefetch as i32),
            ],
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
