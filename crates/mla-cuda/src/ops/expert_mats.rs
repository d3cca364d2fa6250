//! How a layer's stacked expert matrices are stored on the device, for the MoE kernels (grouped
//! GEMMs and the small-step GEMVs): bf16, or block-FP8 as DeepSeek-V3 checkpoints ship them.

use super::linear::FP8_BLOCK;
use crate::gpu::{Arg, DSlice};
use half::bf16;

/// Stacked expert matrices `[experts, n, k]` (one expert: `[n, k]`, PyTorch's `[out, in]`).
#[derive(Clone, Copy)]
pub enum ExpertMats<'a> {
    Bf16(DSlice<'a, bf16>),
    /// e4m3 bytes `[experts, n, k]` and one f32 `scale_inv` per 128x128 block of each expert,
    /// `[experts, ceil(n / 128), ceil(k / 128)]` (the checkpoint's grids, stacked). A fused
    /// gate/up stack `[experts, 2I, k]` stacks the gate grid over the up grid, which is exact only
    /// when `I` is a multiple of 128 (the loader keeps other layers in bf16).
    Fp8 {
        w: DSlice<'a, u8>,
        scale_inv: DSlice<'a, f32>,
    },
}

impl ExpertMats<'_> {
    pub fn is_fp8(&self) -> bool {
        matches!(self, ExpertMats::Fp8 { .. })
    }
}

impl ExpertMats<'_> {
    /// How many `[rows, cols]` matrices the stack holds.
    pub fn count(&self, rows: usize, cols: usize) -> usize {
        let len = match self {
            ExpertMats::Bf16(w) => w.len,
            ExpertMats::Fp8 { w, .. } => w.len,
        };
        len / (rows * cols).max(1)
    }

    /// The kernels' arguments for this stack, after checking that it holds `count` `[rows, cols]`
    /// matrices (and their scale grids) and starts 16-byte aligned: the weight pointer, then for
    /// FP8 the scales' pointer.
    pub(crate) fn args(&self, what: &str, count: usize, rows: usize, cols: usize) -> anyhow::Result<Vec<Arg>> {
        let elems = count * rows * cols;
        let (ptr, len, scales) = match self {
            ExpertMats::Bf16(w) => (w.ptr, w.len, None),
            ExpertMats::Fp8 { w, scale_inv } => (w.ptr, w.len, Some(scale_inv)),
        };
        anyhow::ensure!(len >= elems, "{what}: {len} weights for {count} x [{rows}, {cols}]");
        anyhow::ensure!(ptr.is_multiple_of(16), "{what}: weights not 16-byte aligned");
        let Some(s) = scales else { return Ok(vec![Arg::Ptr(ptr)]) };
        let grid = count * rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK);
        anyhow::ensure!(s.len >= grid, "{what}: {} block scales for {count} x [{rows}, {cols}]", s.len);
        Ok(vec![Arg::Ptr(ptr), Arg::Ptr(s.ptr)])
    }

    /// Null arguments in place of a stack of this format (an absent operand).
    pub(crate) fn null_args(fp8: bool) -> Vec<Arg> {
        vec![Arg::Ptr(0); if fp8 { 2 } else { 1 }]
    }
}
