//! How a layer's stacked expert matrices are stored on the device, for the MoE kernels (grouped
//! GEMMs and the small-step GEMVs): bf16, or block-FP8 as DeepSeek-V3 checkpoints ship them.

use crate::gpu::DSlice;
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
