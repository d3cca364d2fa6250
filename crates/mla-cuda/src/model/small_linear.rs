//! Which kernel runs a dense projection.
//!
//! bf16 weights: for single-row steps (decode at B=1) the weight-streaming GEMV
//! (`ops::GemvKernels`) instead of cuBLAS, whose M = 1 kernels read weights at 1.37 TB/s on the
//! H200 (ncu, run S1 in docs/runs/2026-11-22.md). On the H200 it made B=1 decode 3.5% faster and
//! B=2..4 slower than cuBLAS (runs S4/S5), so steps of more rows, and shapes the kernel cannot
//! take (unaligned rows), go to cuBLAS.
//!
//! Block-FP8 weights (issue 12): steps of up to `FP8_GEMV_MAX_ROWS` (8) rows stream the FP8 bytes
//! through `ops::GemvFp8Kernels` (W8A16, dequantized in registers; half the bytes of bf16; on
//! sm_90 the streaming kernel, tensor cores fed by a cp.async ring with K split over a cluster
//! on narrow shapes, 1-8 rows; elsewhere FMA at 1 row and tensor cores at 2-8). Larger
//! steps, on Hopper, quantize the activations per row and 128 columns and run cuBLASLt's
//! block-scaled FP8 GEMM (W8A8, what DeepGEMM, vLLM and SGLang compute) on the rows up to a
//! multiple of 4, the GEMV on the rest. Otherwise (other GPUs, or `fp8_w8a8` off for exact
//! comparisons) they dequantize the weight into a bf16 scratch matrix (`bf16(fp8 · scale)`, the
//! very weight the bf16 loader used to build) and run cuBLAS: exact W8A16, but 2.5x the bf16
//! bytes.

use super::weights::Fp8Share;
use crate::device::Device;
use crate::gpu::{DSlice, DeviceBuffer, Fp8BlockGemm};
use crate::ops::{fp8_lt_scale_ld, FP8_BLOCK, FP8_GEMV_MAX_ROWS};
use crate::ops::{Fp8Act, Fp8Linear, GemvFp8Kernels, GemvKernels, GemvLaunch, GemvOut, Linear, Proj, Strided};
use half::bf16;

/// Most rows the bf16 GEMV kernel is used for, from the H200 measurements above (the kernel itself
/// takes up to `ops::GEMV_KERNEL_MAX_ROWS`; the GPU test covers all of them).
pub const GEMV_MAX_ROWS: usize = 1;

pub struct SmallLinear {
    /// `CudaOptions::small_batch_gemv`: off sends every bf16 projection to cuBLAS (A/B runs).
    enabled: bool,
    /// Steps of up to this many rows use the bf16 kernel (`GEMV_MAX_ROWS`; tests raise it to
    /// `GEMV_KERNEL_MAX_ROWS`).
    pub max_rows: usize,
    /// Most rows the FP8 GEMV takes before the larger-step path (tests lower it to 0 to run
    /// that path on decode steps).
    pub fp8_gemv_max_rows: usize,
    /// How larger FP8 steps run, with its scratch.
    fp8_large: Fp8Large,
}

/// The path of FP8 projections past the GEMV's rows.
enum Fp8Large {
    /// W8A8: quantized activations `[rows, widest input]` and their scales `[groups, rows]`.
    BlockScaled { q: DeviceBuffer<u8>, scales: DeviceBuffer<f32>, max_rows: usize },
    /// A bf16 copy of one weight, as large as the largest FP8 projection.
    Dequantize { scratch: DeviceBuffer<bf16> },
}

impl SmallLinear {
    /// `fp8`: the model's FP8 projections (all zero without any), whose steps have at most
    /// `max_rows` rows; `w8a8` picks cuBLASLt's block-scaled GEMM for their larger steps.
    pub fn new(enabled: bool, fp8: &Fp8Share, max_rows: usize, w8a8: bool) -> anyhow::Result<Self> {
        let fp8_large = if w8a8 && fp8.matrices > 0 {
            let groups = fp8.widest_input.div_ceil(FP8_BLOCK);
            Fp8Large::BlockScaled {
                q: DeviceBuffer::alloc(max_rows * fp8.widest_input)?,
                scales: DeviceBuffer::alloc(groups * max_rows)?,
                max_rows,
            }
        } else {
            Fp8Large::Dequantize { scratch: DeviceBuffer::alloc(fp8.largest_projection.max(1))? }
        };
        Ok(SmallLinear { enabled, max_rows: GEMV_MAX_ROWS, fp8_gemv_max_rows: FP8_GEMV_MAX_ROWS, fp8_large })
    }

    fn gemv_takes(&self, lin: &Linear, x: &Strided<bf16>, rows: usize) -> bool {
        self.enabled && rows <= self.max_rows && GemvKernels::takes(lin, x, rows)
    }

    fn fp8_gemv_takes(&self, lin: &Fp8Linear, x: &Strided<bf16>, rows: usize) -> bool {
        rows <= self.fp8_gemv_max_rows && GemvFp8Kernels::takes(lin, x, rows)
    }

    /// `ya = x · aᵀ` and `yb = x · bᵀ` (bf16 out) in one launch when both are bf16 and the kernel
    /// takes both, as two `linear` calls otherwise.
    pub fn linear_pair(
        &self,
        dev: &Device,
        x: Strided<bf16>,
        rows: usize,
        a: (&Proj, Strided<bf16>),
        b: (&Proj, Strided<bf16>),
    ) -> anyhow::Result<()> {
        if let (Proj::Bf16(la), Proj::Bf16(lb)) = (a.0, b.0) {
            if self.gemv_takes(la, &x, rows) && self.gemv_takes(lb, &x, rows) && la.inp == lb.inp {
                let p = GemvLaunch { lin: la, x, rows, y: GemvOut::Bf16(a.1), second: Some((lb, GemvOut::Bf16(b.1))) };
                return dev.k.gemv.launch(dev.stream(), &p);
            }
        }
        self.linear(dev, a.0, x, rows, a.1)?;
        self.linear(dev, b.0, x, rows, b.1)
    }

    /// `y[r, :] = x[r, :] · Wᵀ` (bf16 out), as `Blas::linear`.
    pub fn linear(
        &self,
        dev: &Device,
        w: &Proj,
        x: Strided<bf16>,
        rows: usize,
        y: Strided<bf16>,
    ) -> anyhow::Result<()> {
        match w {
            Proj::Bf16(lin) if self.gemv_takes(lin, &x, rows) => {
                dev.k.gemv.launch(dev.stream(), &GemvLaunch { lin, x, rows, y: GemvOut::Bf16(y), second: None })
            }
            Proj::Bf16(lin) => dev.blas.linear(lin, x, rows, y),
            Proj::Fp8 { w, .. } if self.fp8_gemv_takes(w, &x, rows) => {
                dev.k.gemv_fp8.launch(dev.stream(), w, x, rows, GemvOut::Bf16(y))
            }
            Proj::Fp8 { w, lt_scales } => self.fp8_large(dev, w, *lt_scales, x, rows, y),
        }
    }

    fn fp8_large(
        &self,
        dev: &Device,
        w: &Fp8Linear,
        lt_scales: DSlice<f32>,
        x: Strided<bf16>,
        rows: usize,
        y: Strided<bf16>,
    ) -> anyhow::Result<()> {
        if rows == 0 {
            return Ok(());
        }
        match &self.fp8_large {
            Fp8Large::BlockScaled { q, scales, max_rows } => {
                anyhow::ensure!(rows <= *max_rows, "fp8 projection of {rows} rows, scratch for {max_rows}");
                anyhow::ensure!(y.stride >= w.out && y.data.len >= y.need(rows, w.out), "fp8 linear: output too small");
                let need = w.out.div_ceil(FP8_BLOCK) * fp8_lt_scale_ld(w.inp);
                anyhow::ensure!(lt_scales.len >= need, "fp8 linear: {} cuBLASLt scales, {need} needed", lt_scales.len);
                // cuBLASLt's block-scaled kernels take row counts in multiples of 4 only (6 is
                // NOT_SUPPORTED; cuBLASLt 13.1 on an H100, gpu_fp8_gemm's probe): the last
                // rows % 4 rows go through the W8A16 GEMV.
                let main = rows / 4 * 4;
                if main > 0 {
                    // cuBLASLt reads the activation scales packed for the GEMM's own row count.
                    let act = Fp8Act { q: q.slice(), scales: scales.slice(), scale_ld: main };
                    dev.k.fp8_convert.quantize_act(dev.stream(), x, main, w.inp, &act)?;
                    let g = Fp8BlockGemm {
                        rows: main,
                        out: w.out,
                        inp: w.inp,
                        x: act.q.ptr,
                        x_scales: act.scales.ptr,
                        x_scale_ld: act.scale_ld,
                        w: w.w.ptr,
                        w_scales: lt_scales.ptr,
                        y: y.data.ptr,
                        y_stride: y.stride,
                    };
                    dev.blas_lt.fp8_block_gemm(dev.stream(), &g)?;
                }
                if main < rows {
                    let (xt, yt) = (tail_rows(x, main), tail_rows(y, main));
                    dev.k.gemv_fp8.launch(dev.stream(), w, xt, rows - main, GemvOut::Bf16(yt))?;
                }
                Ok(())
            }
            Fp8Large::Dequantize { scratch } => {
                let s = scratch.slice();
                anyhow::ensure!(
                    s.len >= w.out * w.inp,
                    "fp8 projection [{}, {}] exceeds the dequantize scratch ({} values)",
                    w.out,
                    w.inp,
                    s.len
                );
                dev.k.fp8_convert.dequantize(dev.stream(), w, s)?;
                dev.blas.linear(&Linear::new(s, w.out, w.inp), x, rows, y)
            }
        }
    }

    /// Same with f32 output (logits), as `Blas::linear_f32_out` (the head is never FP8).
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

/// The rows of `s` from row `from` on.
fn tail_rows(s: Strided<'_, bf16>, from: usize) -> Strided<'_, bf16> {
    let skip = from * s.stride;
    Strided::new(s.data.sub(skip, s.data.len - skip), s.stride)
}
