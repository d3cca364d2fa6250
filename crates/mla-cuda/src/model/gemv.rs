//! Linear layers of single-row steps (decode at B=1): a weight-streaming kernel
//! (`kernels/gemv.cu`) instead of cuBLAS, whose M = 1 kernels read weights at 1.37 TB/s on the
//! H200 (ncu, run S1 in docs/performance.md). On the H200 it made B=1 decode 3.5% faster and
//! B=2..4 slower than cuBLAS (runs S4/S5), so steps of more rows, and shapes the kernel cannot
//! take (unaligned rows), go to cuBLAS.

use crate::device::Device;
use crate::gpu::{Arg, DSlice, Kernel};
use crate::ops::Linear;
use half::bf16;

/// Most rows the kernel is used for (it handles up to MAXM = 4 in gemv.cu; the GPU test covers
/// 1..=4), from the H200 measurements above.
pub const GEMV_MAX_ROWS: usize = 1;
/// Most rows the kernel can take.
pub const GEMV_KERNEL_MAX_ROWS: usize = 4;
const ROWS_PER_BLOCK: usize = 8; // WARPS * ROWS in gemv.cu

pub struct Gemv {
    kernel: Kernel,
    pub enabled: bool,
    /// Steps of up to this many rows use the kernel (`GEMV_MAX_ROWS`; tests raise it to
    /// `GEMV_KERNEL_MAX_ROWS`).
    pub max_rows: usize,
}

enum Out {
    Bf16(DSlice<bf16>),
    F32(DSlice<f32>),
}

impl Gemv {
    pub fn load(dev: &Device, enabled: bool) -> anyhow::Result<Self> {
        Ok(Gemv { kernel: dev.kernel("gemv", "gemv_bf16")?, enabled, max_rows: GEMV_MAX_ROWS })
    }

    fn fits(&self, lin: &Linear, x: &DSlice<bf16>, x_stride: usize, rows: usize) -> bool {
        self.enabled
            && (1..=self.max_rows).contains(&rows)
            && lin.inp % 8 == 0
            && x_stride % 8 == 0
            && x.ptr % 16 == 0
            && lin.w.ptr % 16 == 0
            && lin.out < i32::MAX as usize
            && lin.inp < i32::MAX as usize
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(&self, dev: &Device, lin: &Linear, x: DSlice<bf16>, x_stride: usize, rows: usize, y: Out, y_stride: usize) -> anyhow::Result<()> {
        anyhow::ensure!(x.len >= (rows - 1) * x_stride + lin.inp, "gemv input: {} elements, {} needed", x.len, (rows - 1) * x_stride + lin.inp);
        anyhow::ensure!(y_stride >= lin.out, "gemv output stride {y_stride} < {}", lin.out);
        let need = (rows - 1) * y_stride + lin.out;
        let (ptr, f32_out) = match y {
            Out::Bf16(s) => {
                anyhow::ensure!(s.len >= need, "gemv output: {} elements, {need} needed", s.len);
                (s.ptr, 0)
            }
            Out::F32(s) => {
                anyhow::ensure!(s.len >= need, "gemv output: {} elements, {need} needed", s.len);
                (s.ptr, 1)
            }
        };
        let grid = lin.out.div_ceil(ROWS_PER_BLOCK) as u32;
        self.kernel.launch(
            dev.stream(),
            (grid, 1, 1),
            128,
            0,
            &[
                Arg::Ptr(lin.w.ptr),
                Arg::I32(lin.out as i32),
                Arg::I32(lin.inp as i32),
                Arg::Ptr(x.ptr),
                Arg::I32(x_stride as i32),
                Arg::I32(rows as i32),
                Arg::Ptr(ptr),
                Arg::I32(y_stride as i32),
                Arg::I32(f32_out),
            ],
        )?;
        Ok(())
    }

    /// `y[r, :] = x[r, :] · Wᵀ` (bf16 out), as `Blas::linear`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(&self, dev: &Device, lin: &Linear, x: DSlice<bf16>, x_stride: usize, rows: usize, y: DSlice<bf16>, y_stride: usize) -> anyhow::Result<()> {
        if self.fits(lin, &x, x_stride, rows) {
            self.launch(dev, lin, x, x_stride, rows, Out::Bf16(y), y_stride)
        } else {
            dev.blas.linear(lin, x, x_stride, rows, y, y_stride)
        }
    }

    /// Same with f32 output (logits), as `Blas::linear_f32_out`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_f32_out(&self, dev: &Device, lin: &Linear, x: DSlice<bf16>, x_stride: usize, rows: usize, y: DSlice<f32>, y_stride: usize) -> anyhow::Result<()> {
        if self.fits(lin, &x, x_stride, rows) {
            self.launch(dev, lin, x, x_stride, rows, Out::F32(y), y_stride)
        } else {
            dev.blas.linear_f32_out(lin, x, x_stride, rows, y, y_stride)
        }
    }
}
