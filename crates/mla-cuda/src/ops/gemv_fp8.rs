//! kernels/gemv_fp8.cu: `y = x · Wᵀ` for 1 to `GEMV_KERNEL_MAX_ROWS` rows on a block-FP8 weight
//! (e4m3 bytes with one f32 `scale_inv` per 128x128 block, DeepSeek-V3's checkpoint layout),
//! streaming the weight bytes and dequantizing in registers (W8A16). The decode-path kernel of
//! issue 12's FP8 weights; the model does not call it yet.

use super::dims::{GEMV_KERNEL_MAX_ROWS, GEMV_ROWS_PER_BLOCK};
use super::gemv::GemvOut;
use super::linear::Strided;
use crate::gpu::{Arg, DSlice, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;

/// Rows and columns of one scale block (DeepSeek-V3's `weight_block_size`).
pub const FP8_BLOCK: usize = 128;

/// A block-FP8 weight `[out, inp]` on the device.
#[derive(Clone, Copy)]
pub struct Fp8Linear<'a> {
    pub w: DSlice<'a, u8>,
    /// `[ceil(out / 128), ceil(inp / 128)]`, row-major.
    pub scale_inv: DSlice<'a, f32>,
    pub out: usize,
    pub inp: usize,
}

impl Fp8Linear<'_> {
    /// Checks that the bytes and the scale grid hold the whole `[out, inp]` weight (`what` names
    /// the caller in the error).
    pub fn check(&self, what: &str) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.out > 0 && self.inp > 0 && self.out * self.inp < i32::MAX as usize,
            "{what}: fp8 weight [{}, {}]",
            self.out,
            self.inp
        );
        anyhow::ensure!(
            self.w.len >= self.out * self.inp,
            "{what}: {} bytes for [{}, {}]",
            self.w.len,
            self.out,
            self.inp
        );
        let grid = self.out.div_ceil(FP8_BLOCK) * self.inp.div_ceil(FP8_BLOCK);
        anyhow::ensure!(self.scale_inv.len >= grid, "{what}: {} scales for a grid of {grid}", self.scale_inv.len);
        Ok(())
    }
}

pub struct GemvFp8Kernels {
    gemv: Kernel,
}

impl GemvFp8Kernels {
    pub fn load(m: &Modules) -> anyhow::Result<Self> {
        Ok(GemvFp8Kernels { gemv: m.kernel("gemv_fp8", "gemv_fp8_block")? })
    }

    /// Whether the kernel can take these operands: K a multiple of 16 (16-byte weight loads),
    /// the input stride a multiple of 8, both 16-byte aligned, at most `GEMV_KERNEL_MAX_ROWS`
    /// rows, sizes that fit its int arguments.
    pub fn takes(lin: &Fp8Linear, x: &Strided<bf16>, rows: usize) -> bool {
        (1..=GEMV_KERNEL_MAX_ROWS).contains(&rows)
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
        anyhow::ensure!(Self::takes(lin, &x, rows), "gemv_fp8: operands the kernel cannot take ({rows} rows)");
        lin.check("gemv_fp8")?;
        let need = x.need(rows, lin.inp);
        anyhow::ensure!(x.data.len >= need, "gemv_fp8 input: {} elements, {need} needed", x.data.len);
        let (ptr, len, stride) = y.ptr_len_stride();
        anyhow::ensure!(stride >= lin.out, "gemv_fp8 output stride {stride} < {}", lin.out);
        anyhow::ensure!(len >= (rows - 1) * stride + lin.out, "gemv_fp8 output: {len} elements too few");
        self.gemv.launch(
            s,
            (lin.out.div_ceil(GEMV_ROWS_PER_BLOCK) as u32, 1, 1),
            128,
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
