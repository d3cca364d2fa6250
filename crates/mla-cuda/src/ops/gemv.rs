//! kernels/gemv.cu: `y = x · Wᵀ` for 1 to `GEMV_KERNEL_MAX_ROWS` rows, streaming the weight at
//! memory bandwidth; optionally a second weight over the same input in the same launch. When the
//! model uses it instead of cuBLAS is `model::small_linear`'s decision.

use super::dims::{GEMV_KERNEL_MAX_ROWS, GEMV_ROWS_PER_BLOCK};
use super::linear::{Linear, Strided};
use crate::gpu::{Arg, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;

pub struct GemvKernels {
    gemv: Kernel,
}

/// Where a GEMV writes: bf16 activations or f32 logits.
#[derive(Clone, Copy)]
pub enum GemvOut<'a> {
    Bf16(Strided<'a, bf16>),
    F32(Strided<'a, f32>),
}

impl GemvOut<'_> {
    pub(super) fn ptr_len_stride(&self) -> (u64, usize, usize) {
        match self {
            GemvOut::Bf16(s) => (s.data.ptr, s.data.len, s.stride),
            GemvOut::F32(s) => (s.data.ptr, s.data.len, s.stride),
        }
    }

    pub(super) fn is_f32(&self) -> bool {
        matches!(self, GemvOut::F32(_))
    }
}

/// One launch: `rows` rows of `x` through `lin` into `y`, and through `second` when given (same
/// input width and output type).
pub struct GemvLaunch<'a> {
    pub lin: &'a Linear<'a>,
    pub x: Strided<'a, bf16>,
    pub rows: usize,
    pub y: GemvOut<'a>,
    pub second: Option<(&'a Linear<'a>, GemvOut<'a>)>,
}

impl GemvKernels {
    pub fn load(m: &Modules) -> anyhow::Result<Self> {
        Ok(GemvKernels { gemv: m.kernel("gemv", "gemv_bf16")? })
    }

    /// Whether the kernel can take these operands: K and the input stride multiples of 8, both
    /// 16-byte aligned, at most `GEMV_KERNEL_MAX_ROWS` rows, sizes that fit its int arguments.
    pub fn takes(lin: &Linear, x: &Strided<bf16>, rows: usize) -> bool {
        (1..=GEMV_KERNEL_MAX_ROWS).contains(&rows)
            && lin.inp.is_multiple_of(8)
            && x.stride.is_multiple_of(8)
            && x.data.ptr.is_multiple_of(16)
            && lin.w.ptr.is_multiple_of(16)
            && lin.out < i32::MAX as usize
            && lin.inp < i32::MAX as usize
    }

    pub fn launch(&self, s: CUstream, p: &GemvLaunch) -> anyhow::Result<()> {
        let (lin, rows) = (p.lin, p.rows);
        anyhow::ensure!(Self::takes(lin, &p.x, rows), "gemv: operands the kernel cannot take ({rows} rows)");
        let need = p.x.need(rows, lin.inp);
        anyhow::ensure!(p.x.data.len >= need, "gemv input: {} elements, {need} needed", p.x.data.len);
        let (ptr, stride) = checked_out(lin, rows, &p.y)?;
        let mut grid = lin.out.div_ceil(GEMV_ROWS_PER_BLOCK);
        let (mut w2, mut n2, mut ptr2, mut stride2) = (0, 0, 0, 0);
        if let Some((lin2, y2)) = &p.second {
            anyhow::ensure!(lin2.inp == lin.inp, "paired gemv: K {} and {} differ", lin.inp, lin2.inp);
            anyhow::ensure!(y2.is_f32() == p.y.is_f32(), "paired gemv: output types differ");
            let (pp, ss) = checked_out(lin2, rows, y2)?;
            (w2, n2, ptr2, stride2) = (lin2.w.ptr, lin2.out, pp, ss);
            grid += lin2.out.div_ceil(GEMV_ROWS_PER_BLOCK);
        }
        self.gemv.launch(
            s,
            (grid as u32, 1, 1),
            128,
            0,
            &[
                Arg::Ptr(lin.w.ptr),
                Arg::I32(lin.out as i32),
                Arg::I32(lin.inp as i32),
                Arg::Ptr(p.x.data.ptr),
                Arg::I32(p.x.stride as i32),
                Arg::I32(rows as i32),
                Arg::Ptr(ptr),
                Arg::I32(stride as i32),
                Arg::I32(p.y.is_f32() as i32),
                Arg::Ptr(w2),
                Arg::I32(n2 as i32),
                Arg::Ptr(ptr2),
                Arg::I32(stride2 as i32),
            ],
        )?;
        Ok(())
    }
}

/// Checks an output against its matrix; returns its pointer and row stride.
fn checked_out(lin: &Linear, rows: usize, y: &GemvOut) -> anyhow::Result<(u64, usize)> {
    let (ptr, len, stride) = y.ptr_len_stride();
    anyhow::ensure!(stride >= lin.out, "gemv output stride {stride} < {}", lin.out);
    let need = (rows - 1) * stride + lin.out;
    anyhow::ensure!(len >= need, "gemv output: {len} elements, {need} needed");
    Ok((ptr, stride))
}
