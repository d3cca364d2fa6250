//! kernels/gemv_fp8.cu: `y = x · Wᵀ` for 1 to `FP8_GEMV_MAX_ROWS` rows on a block-FP8 weight
//! (e4m3 bytes with one f32 `scale_inv` per 128x128 block, DeepSeek-V3's checkpoint layout),
//! streaming the weight bytes and dequantizing in registers (W8A16), in two kernels: FMAs per
//! weight, or bf16 tensor-core MMAs on the converted weights (exact products either way). The
//! decode-path kernel of issue 12's FP8 weights (`model::small_linear`).

use super::dims::{FP8_GEMV_MAX_ROWS, GEMV_KERNEL_MAX_ROWS, GEMV_ROWS_PER_BLOCK};
use super::gemv::GemvOut;
use super::linear::{Fp8Linear, Strided};
use crate::gpu::{Arg, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;

/// Which FP8 GEMV kernel runs (tests and benchmarks run each; `launch` picks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8GemvKind {
    /// `gemv_fp8_block`: a warp streams 2 weight rows, FMAs per weight and input row.
    Fma,
    /// `gemv_fp8_mma`: a warp takes 16 weight rows, 8 warps split K, mma.sync m16n8k16.
    Mma,
}

impl Fp8GemvKind {
    pub const ALL: [Fp8GemvKind; 2] = [Fp8GemvKind::Fma, Fp8GemvKind::Mma];
}

pub struct GemvFp8Kernels {
    fma: Kernel,
    mma: Kernel,
}

impl GemvFp8Kernels {
    pub fn load(m: &Modules) -> anyhow::Result<Self> {
        Ok(GemvFp8Kernels { fma: m.kernel("gemv_fp8", "gemv_fp8_block")?, mma: m.kernel("gemv_fp8", "gemv_fp8_mma")? })
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
        anyhow::ensure!(Self::takes(lin, &x, rows), "gemv_fp8: operands the kernel cannot take ({rows} rows)");
        anyhow::ensure!(
            kind == Fp8GemvKind::Mma || rows <= GEMV_KERNEL_MAX_ROWS,
            "gemv_fp8: the FMA kernel takes at most {GEMV_KERNEL_MAX_ROWS} rows, not {rows}"
        );
        lin.check("gemv_fp8")?;
        let need = x.need(rows, lin.inp);
        anyhow::ensure!(x.data.len >= need, "gemv_fp8 input: {} elements, {need} needed", x.data.len);
        let (ptr, len, stride) = y.ptr_len_stride();
        anyhow::ensure!(stride >= lin.out, "gemv_fp8 output stride {stride} < {}", lin.out);
        anyhow::ensure!(len >= (rows - 1) * stride + lin.out, "gemv_fp8 output: {len} elements too few");
        let (kernel, blocks, threads) = match kind {
            Fp8GemvKind::Fma => (&self.fma, lin.out.div_ceil(GEMV_ROWS_PER_BLOCK), 128),
            Fp8GemvKind::Mma => (&self.mma, lin.out.div_ceil(16), 256),
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
}
