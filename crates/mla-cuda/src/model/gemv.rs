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
            && lin.inp.is_multiple_of(8)
            && x_stride.is_multiple_of(8)
            && x.ptr.is_multiple_of(16)
            && lin.w.ptr.is_multiple_of(16)
            && lin.out < i32::MAX as usize
            && lin.inp < i32::MAX as usize
    }

    /// Checks an output against its matrix; returns its pointer and whether it is f32.
    fn output(lin: &Linear, rows: usize, y: Out, y_stride: usize) -> anyhow::Result<(u64, i32)> {
        anyhow::ensure!(y_stride >= lin.out, "gemv output stride {y_stride} < {}", lin.out);
        let need = (rows - 1) * y_stride + lin.out;
        let (len, ptr, f32_out) = match y {
            Out::Bf16(s) => (s.len, s.ptr, 0),
            Out::F32(s) => (s.len, s.ptr, 1),
        };
        anyhow::ensure!(len >= need, "gemv output: {len} elements, {need} needed");
        Ok((ptr, f32_out))
    }

    /// One launch for `lin` and, when given, a second matrix over the same input (same K and
    /// output type).
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        dev: &Device,
        lin: &Linear,
        x: DSlice<bf16>,
        x_stride: usize,
        rows: usize,
        y: Out,
        y_stride: usize,
        second: Option<(&Linear, Out, usize)>,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            x.len >= (rows - 1) * x_stride + lin.inp,
            "gemv input: {} elements, {} needed",
            x.len,
            (rows - 1) * x_stride + lin.inp
        );
        let (ptr, f32_out) = Self::output(lin, rows, y, y_stride)?;
        let mut grid = lin.out.div_ceil(ROWS_PER_BLOCK);
        let (mut w2, mut n2, mut ptr2, mut stride2) = (0, 0, 0, 0);
        if let Some((lin2, y2, y2_stride)) = second {
            anyhow::ensure!(lin2.inp == lin.inp, "paired gemv: K {} and {} differ", lin.inp, lin2.inp);
            let (p2, f2) = Self::output(lin2, rows, y2, y2_stride)?;
            anyhow::ensure!(f2 == f32_out, "paired gemv: output types differ");
            (w2, n2, ptr2, stride2) = (lin2.w.ptr, lin2.out, p2, y2_stride);
            grid += lin2.out.div_ceil(ROWS_PER_BLOCK);
        }
        self.kernel.launch(
            dev.stream(),
            (grid as u32, 1, 1),
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
                Arg::Ptr(w2),
                Arg::I32(n2 as i32),
                Arg::Ptr(ptr2),
                Arg::I32(stride2 as i32),
            ],
        )?;
        Ok(())
    }

    /// `ya = x · aᵀ` and `yb = x · bᵀ` (bf16 out) in one launch when the kernel takes both,
    /// as two `linear` calls otherwise.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_pair(
        &self,
        dev: &Device,
        x: DSlice<bf16>,
        x_stride: usize,
        rows: usize,
        a: (&Linear, DSlice<bf16>, usize),
        b: (&Linear, DSlice<bf16>, usize),
    ) -> anyhow::Result<()> {
        if self.fits(a.0, &x, x_stride, rows) && self.fits(b.0, &x, x_stride, rows) && a.0.inp == b.0.inp {
            return self.launch(dev, a.0, x, x_stride, rows, Out::Bf16(a.1), a.2, Some((b.0, Out::Bf16(b.1), b.2)));
        }
        self.linear(dev, a.0, x, x_stride, rows, a.1, a.2)?;
        self.linear(dev, b.0, x, x_stride, rows, b.1, b.2)
    }

    /// `y[r, :] = x[r, :] · Wᵀ` (bf16 out), as `Blas::linear`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        dev: &Device,
        lin: &Linear,
        x: DSlice<bf16>,
        x_stride: usize,
        rows: usize,
        y: DSlice<bf16>,
        y_stride: usize,
    ) -> anyhow::Result<()> {
        if self.fits(lin, &x, x_stride, rows) {
            self.launch(dev, lin, x, x_stride, rows, Out::Bf16(y), y_stride, None)
        } else {
            dev.blas.linear(lin, x, x_stride, rows, y, y_stride)
        }
    }

    /// Same with f32 output (logits), as `Blas::linear_f32_out`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_f32_out(
        &self,
        dev: &Device,
        lin: &Linear,
        x: DSlice<bf16>,
        x_stride: usize,
        rows: usize,
        y: DSlice<f32>,
        y_stride: usize,
    ) -> anyhow::Result<()> {
        if self.fits(lin, &x, x_stride, rows) {
            self.launch(dev, lin, x, x_stride, rows, Out::F32(y), y_stride, None)
        } else {
            dev.blas.linear_f32_out(lin, x, x_stride, rows, y, y_stride)
        }
    }
}
