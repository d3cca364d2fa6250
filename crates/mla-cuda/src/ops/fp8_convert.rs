//! kernels/fp8_convert.cu: block-FP8 weights made on the device (`--quantization fp8`, FP8 dummy
//! weights) and turned back into bf16 for the cuBLAS path of prefill-sized steps.

use super::grid_for;
use super::linear::{Fp8Linear, FP8_BLOCK};
use crate::gpu::{Arg, DSlice, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;

pub struct Fp8ConvertKernels {
    quantize: Kernel,
    dequantize: Kernel,
    pub(super) quantize_act: Kernel,
    sm_count: usize,
}

impl Fp8ConvertKernels {
    pub fn load(m: &Modules, sm_count: usize) -> anyhow::Result<Self> {
        let k = |name| m.kernel("fp8_convert", name);
        Ok(Fp8ConvertKernels {
            quantize: k("fp8_quantize_block")?,
            dequantize: k("fp8_dequantize_bf16")?,
            quantize_act: k("fp8_quantize_act")?,
            sm_count,
        })
    }

    /// Quantizes the bf16 `[out, inp]` weight `w` into `dst` (bytes and scale grid), with
    /// DeepSeek's recipe, bit-exact with `mla_core::model::fp8::quantize_block_fp8`.
    pub fn quantize(&self, s: CUstream, w: DSlice<bf16>, dst: &Fp8Linear) -> anyhow::Result<()> {
        let (rows, cols) = (dst.out, dst.inp);
        dst.check("fp8 quantize")?;
        anyhow::ensure!(w.len >= rows * cols, "fp8 quantize: {} bf16 values for [{rows}, {cols}]", w.len);
        let grid = (cols.div_ceil(FP8_BLOCK) as u32, rows.div_ceil(FP8_BLOCK) as u32, 1);
        self.quantize.launch(
            s,
            grid,
            256,
            0,
            &[
                Arg::Ptr(w.ptr),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::Ptr(dst.w.ptr),
                Arg::Ptr(dst.scale_inv.ptr),
            ],
        )?;
        Ok(())
    }

    /// Writes `bf16(fp8 · scale_inv)` of `src` into `out` (`[out, inp]`, `inp` a multiple of 16).
    pub fn dequantize(&self, s: CUstream, src: &Fp8Linear, out: DSlice<bf16>) -> anyhow::Result<()> {
        let (rows, cols) = (src.out, src.inp);
        src.check("fp8 dequantize")?;
        anyhow::ensure!(
            cols.is_multiple_of(16) && src.w.ptr.is_multiple_of(16) && out.ptr.is_multiple_of(16),
            "fp8 dequantize: [{rows}, {cols}] needs 16-byte aligned rows"
        );
        anyhow::ensure!(out.len >= rows * cols, "fp8 dequantize: output holds {} of {} values", out.len, rows * cols);
        self.dequantize.launch(
            s,
            (grid_for(self.sm_count, rows * cols / 16, 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(src.w.ptr),
                Arg::Ptr(src.scale_inv.ptr),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::Ptr(out.ptr),
            ],
        )?;
        Ok(())
    }
}
