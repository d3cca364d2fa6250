//! Which kernel runs a dense projection: for single-row steps (decode at B=1) the weight-streaming
//! GEMV (`ops::GemvKernels`) instead of cuBLAS, whose M = 1 kernels read weights at 1.37 TB/s on
//! the H200 (ncu, run S1 in docs/runs/2026-11-22.md). On the H200 it made B=1 decode 3.5% faster
//! and B=2..4 slower than cuBLAS (runs S4/S5), so steps of more rows, and shapes the kernel cannot
//! take (unaligned rows), go to cuBLAS.

use crate::device::Device;
use crate::ops::{GemvKernels, GemvLaunch, GemvOut, Linear, Strided};
use half::bf16;

/// Most rows the GEMV kernel is used for, from the H200 measurements above (the kernel itself
/// takes up to `ops::GEMV_KERNEL_MAX_ROWS`; the GPU test covers all of them).
pub const GEMV_MAX_ROWS: usize = 1;

pub struct SmallLinear {
    /// `CudaOptions::small_batch_gemv`: off sends every projection to cuBLAS (A/B runs).
    enabled: bool,
    /// Steps of up to this many rows use the kernel (`GEMV_MAX_ROWS`; tests raise it to
    /// `GEMV_KERNEL_MAX_ROWS`).
    pub max_rows: usize,
}

impl SmallLinear {
    pub fn new(enabled: bool) -> Self {
        SmallLinear { enabled, max_rows: GEMV_MAX_ROWS }
    }

    fn gemv_takes(&self, lin: &Linear, x: &Strided<bf16>, rows: usize) -> bool {
        self.enabled && rows <= self.max_rows && GemvKernels::takes(lin, x, rows)
    }

    /// `ya = x · aᵀ` and `yb = x · bᵀ` (bf16 out) in one launch when the kernel takes both, as
    /// two `linear` calls otherwise.
    pub fn linear_pair(
        &self,
        dev: &Device,
        x: Strided<bf16>,
        rows: usize,
        a: (&Linear, Strided<bf16>),
        b: (&Linear, Strided<bf16>),
    ) -> anyhow::Result<()> {
        if self.gemv_takes(a.0, &x, rows) && self.gemv_takes(b.0, &x, rows) && a.0.inp == b.0.inp {
            let p = GemvLaunch { lin: a.0, x, rows, y: GemvOut::Bf16(a.1), second: Some((b.0, GemvOut::Bf16(b.1))) };
            return dev.k.gemv.launch(dev.stream(), &p);
        }
        self.linear(dev, a.0, x, rows, a.1)?;
        self.linear(dev, b.0, x, rows, b.1)
    }

    /// `y[r, :] = x[r, :] · Wᵀ` (bf16 out), as `Blas::linear`.
    pub fn linear(
        &self,
        dev: &Device,
        lin: &Linear,
        x: Strided<bf16>,
        rows: usize,
        y: Strided<bf16>,
    ) -> anyhow::Result<()> {
        if self.gemv_takes(lin, &x, rows) {
            dev.k.gemv.launch(dev.stream(), &GemvLaunch { lin, x, rows, y: GemvOut::Bf16(y), second: None })
        } else {
            dev.blas.linear(lin, x, rows, y)
        }
    }

    /// Same with f32 output (logits), as `Blas::linear_f32_out`.
    pub fn linear_f32_out(
        &self,
        dev: &Device,
        lin: &Linear,
        x: Strided<bf16>,
        rows: usize,
        y: Strided<f32>,
    ) -> anyhow::Result<()> {
        if self.gemv_takes(lin, &x, rows) {
            dev.k.gemv.launch(dev.stream(), &GemvLaunch { lin, x, rows, y: GemvOut::F32(y), second: None })
        } else {
            dev.blas.linear_f32_out(lin, x, rows, y)
        }
    }
}
