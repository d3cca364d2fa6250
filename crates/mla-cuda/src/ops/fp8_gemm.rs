//! The activation side of W8A8 block-scaled FP8 projections (issue 12): kernels/fp8_convert.cu's
//! quantizer, per row and 128 columns, into the layout cuBLASLt's block-scaled GEMM
//! (`gpu::BlasLt`) reads. `model::small_linear` runs the two.

use super::fp8_convert::Fp8ConvertKernels;
use super::linear::Strided;
use super::linear::FP8_BLOCK;
use crate::gpu::{Arg, DSlice};
use cudarc::driver::sys::CUstream;
use half::bf16;

/// Scratch for the quantized activations of one projection.
#[derive(Clone, Copy)]
pub struct Fp8Act<'a> {
    /// e4m3 `[rows, inp]`, packed.
    pub q: DSlice<'a, u8>,
    /// `[ceil(inp / 128), scale_ld]` f32.
    pub scales: DSlice<'a, f32>,
    /// Rows the scale buffer has room for (its leading dimension).
    pub scale_ld: usize,
}

impl Fp8ConvertKernels {
    /// Quantizes `rows` rows of `x` (width `cols`) into `act`.
    pub fn quantize_act(
        &self,
        s: CUstream,
        x: Strided<bf16>,
        rows: usize,
        cols: usize,
        act: &Fp8Act,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(x.stride >= cols && x.data.len >= x.need(rows, cols), "fp8 activations: input too small");
        self.quantize_rows(s, x, None, rows, cols, act)
    }

    /// Quantizes rows `src_rows[0..rows]` of `x` (width `cols`) into rows `0..rows` of `act`: a
    /// gather and the quantizer in one pass (the MoE layer's rows grouped by expert). The indices
    /// come from the device (`MoeKernels::align`) and must be rows of `x`.
    pub fn quantize_act_gather(
        &self,
        s: CUstream,
        x: Strided<bf16>,
        src_rows: DSlice<i32>,
        rows: usize,
        cols: usize,
        act: &Fp8Act,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(src_rows.len >= rows, "fp8 activations: {} row indices for {rows} rows", src_rows.len);
        anyhow::ensure!(x.stride >= cols && x.data.len >= cols, "fp8 activations: input too small");
        self.quantize_rows(s, x, Some(src_rows), rows, cols, act)
    }

    fn quantize_rows(
        &self,
        s: CUstream,
        x: Strided<bf16>,
        src_rows: Option<DSlice<i32>>,
        rows: usize,
        cols: usize,
        act: &Fp8Act,
    ) -> anyhow::Result<()> {
        let groups = cols.div_ceil(FP8_BLOCK);
        anyhow::ensure!(rows <= act.scale_ld, "fp8 activations: {rows} rows, scales for {}", act.scale_ld);
        anyhow::ensure!(act.q.len >= rows * cols, "fp8 activations: {} bytes for [{rows}, {cols}]", act.q.len);
        anyhow::ensure!(act.scales.len >= groups * act.scale_ld, "fp8 activation scales: {}", act.scales.len);
        // 8-byte loads and 4-byte stores where every row allows them (the kernel's `vec`).
        let vec = x.stride.is_multiple_of(4)
            && cols.is_multiple_of(4)
            && x.data.ptr.is_multiple_of(8)
            && act.q.ptr.is_multiple_of(4);
        self.quantize_act.launch(
            s,
            (groups as u32, rows.div_ceil(8) as u32, 1),
            256,
            0,
            &[
                Arg::Ptr(x.data.ptr),
                Arg::I32(x.stride as i32),
                Arg::Ptr(src_rows.map_or(0, |r| r.ptr)),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::Ptr(act.q.ptr),
                Arg::Ptr(act.scales.ptr),
                Arg::I32(act.scale_ld as i32),
                Arg::I32(vec as i32),
            ],
        )?;
        Ok(())
    }
}
