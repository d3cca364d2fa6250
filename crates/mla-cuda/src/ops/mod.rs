//! Typed wrappers around every kernel: each checks shapes and sizes against its parameter
//! struct before queueing the launch on the device's stream.

mod attention;
mod elementwise;
mod latent;
mod linear;
mod moe;
mod sampling;

pub use attention::{
    DecodeAttention, DecodeKernel, PrefillAttention, PrefillKernel, PrefillPass, COMBINE_ABSORB_MAX_BATCH,
    DECODE_HEAD_TILE, LATENT, NOPE, PAGE_SIZE, PREFILL_TILE_Q, ROPE, V_HEAD,
};
pub use elementwise::Normal;
pub use latent::{AbsorbQ, RopeCache};
pub use linear::Linear;
pub use moe::{
    MoeRouting, RouteMethod, Sm90Schedule, GROUPED_SM90_SMEM_BYTES, GROUPED_TILE_M, GROUPED_TILE_M_SM90,
    GROUPED_TILE_M_SMALL,
};
pub use sampling::{SampleParamsRaw, SamplerOutputs, MAX_TOP_LOGPROBS};

use crate::gpu::{GpuInfo, Kernel, Modules};

/// Every kernel function, looked up once.
pub struct Kernels {
    pub embedding_gather: Kernel,
    pub rmsnorm_f32: Kernel,
    pub add_rmsnorm: Kernel,
    pub rmsnorm_bf16: Kernel,
    pub silu_mul: Kernel,
    pub bf16_to_f32: Kernel,
    pub fill_normal_bf16: Kernel,
    pub fill_normal_f32: Kernel,
    pub mla_rope_cache: Kernel,
    pub mla_rope_absorb_q: Kernel,
    pub gather_latent: Kernel,
    pub mla_prefill_attention: Kernel,
    pub mla_prefill_attention_sm90_sync: Kernel,
    /// Which prefill attention kernel `prefill_attention` launches on this GPU.
    pub prefill_kernel: PrefillKernel,
    pub mla_decode_attention_qregs: Kernel,
    pub mla_decode_attention_w8: Kernel,
    pub mla_decode_combine: Kernel,
    pub mla_decode_combine_absorb_o: Kernel,
    pub moe_route: Kernel,
    pub moe_align: Kernel,
    pub moe_gather: Kernel,
    pub moe_combine: Kernel,
    pub moe_grouped_gemm: Kernel,
    pub moe_grouped_gemm_small: Kernel,
    pub moe_grouped_gemm_sm90: Kernel,
    pub moe_grouped_gemm_silu_sm90: Kernel,
    pub moe_grouped_gemm_sm90_n128: Kernel,
    pub moe_grouped_gemm_silu_sm90_n128: Kernel,
    /// Whether batches with more than 16 rows per expert run the wgmma grouped GEMMs (128-row
    /// tiles, sm_90) instead of mma.sync's 64-row tiles.
    pub moe_wgmma: bool,
    pub sample_tokens: Kernel,
    pub sm_count: usize,
}

impl Kernels {
    pub fn load(m: &Modules, info: &GpuInfo) -> anyhow::Result<Self> {
        let k = Kernels {
            embedding_gather: m.kernel("elementwise", "embedding_gather")?,
            rmsnorm_f32: m.kernel("elementwise", "rmsnorm_f32")?,
            add_rmsnorm: m.kernel("elementwise", "add_rmsnorm")?,
            rmsnorm_bf16: m.kernel("elementwise", "rmsnorm_bf16")?,
            silu_mul: m.kernel("elementwise", "silu_mul")?,
            bf16_to_f32: m.kernel("elementwise", "bf16_to_f32")?,
            fill_normal_bf16: m.kernel("elementwise", "fill_normal_bf16")?,
            fill_normal_f32: m.kernel("elementwise", "fill_normal_f32")?,
            mla_rope_cache: m.kernel("latent_cache", "mla_rope_cache")?,
            mla_rope_absorb_q: m.kernel("latent_cache", "mla_rope_absorb_q")?,
            gather_latent: m.kernel("latent_cache", "gather_latent")?,
            mla_prefill_attention: m.kernel("attention_prefill", "mla_prefill_attention")?,
            mla_prefill_attention_sm90_sync: m.kernel("attention_prefill_sm90", "mla_prefill_attention_sm90_sync")?,
            // The wgmma kernel exists only in the sm_90a cubin, which is what compute capability 9.0
            // loads; every other GPU runs the mma.sync kernel from PTX.
            prefill_kernel: if info.compute_capability == (9, 0) {
                PrefillKernel::WgmmaLockstep
            } else {
                PrefillKernel::MmaSync
            },
            // Q in registers, QKᵀ split over the dims, on every GPU (cubin and PTX): 6-9% faster
            // than the one-chain kernel it replaced at B=32/128/256 in run D4 (docs/cuda-notes.md,
            // "Decode attention").
            mla_decode_attention_qregs: m.kernel("attention_decode", "mla_decode_attention_qregs")?,
            mla_decode_attention_w8: m.kernel("attention_decode", "mla_decode_attention_w8")?,
            mla_decode_combine: m.kernel("attention_decode", "mla_decode_combine")?,
            mla_decode_combine_absorb_o: m.kernel("attention_decode", "mla_decode_combine_absorb_o")?,
            moe_route: m.kernel("moe", "moe_route")?,
            moe_align: m.kernel("moe", "moe_align")?,
            moe_gather: m.kernel("moe", "moe_gather")?,
            moe_combine: m.kernel("moe", "moe_combine")?,
            moe_grouped_gemm: m.kernel("grouped_gemm", "moe_grouped_gemm")?,
            moe_grouped_gemm_small: m.kernel("grouped_gemm", "moe_grouped_gemm_small")?,
            moe_grouped_gemm_sm90: m.kernel("grouped_gemm_sm90", "moe_grouped_gemm_sm90")?,
            moe_grouped_gemm_silu_sm90: m.kernel("grouped_gemm_sm90", "moe_grouped_gemm_silu_sm90")?,
            moe_grouped_gemm_sm90_n128: m.kernel("grouped_gemm_sm90", "moe_grouped_gemm_sm90_n128")?,
            moe_grouped_gemm_silu_sm90_n128: m.kernel("grouped_gemm_sm90", "moe_grouped_gemm_silu_sm90_n128")?,
            // Like the wgmma attention kernel, these exist only in the sm_90a cubin.
            moe_wgmma: info.compute_capability == (9, 0),
            sample_tokens: m.kernel("sampling", "sample_tokens")?,
            sm_count: info.sm_count,
        };
        let need = attention::PREFILL_SMEM_BYTES.max(attention::DECODE_SMEM_BYTES).max(match k.prefill_kernel {
            PrefillKernel::MmaSync => 0,
            _ => attention::PREFILL_SM90_SMEM_BYTES,
        });
        anyhow::ensure!(
            info.max_smem_per_block_optin >= need,
            "{} offers {} bytes of shared memory per block; the attention kernels need {need}",
            info.name,
            info.max_smem_per_block_optin
        );
        k.mla_prefill_attention.set_max_dynamic_smem(attention::PREFILL_SMEM_BYTES)?;
        k.mla_decode_attention_qregs.set_max_dynamic_smem(attention::DECODE_SMEM_BYTES)?;
        k.mla_decode_attention_w8.set_max_dynamic_smem(attention::DECODE_W8_SMEM_BYTES)?;
        if k.prefill_kernel != PrefillKernel::MmaSync {
            k.mla_prefill_attention_sm90_sync.set_max_dynamic_smem(attention::PREFILL_SM90_SMEM_BYTES)?;
        }
        if k.moe_wgmma {
            anyhow::ensure!(
                info.max_smem_per_block_optin >= GROUPED_SM90_SMEM_BYTES,
                "{} offers {} bytes of shared memory per block; the wgmma grouped GEMM needs {GROUPED_SM90_SMEM_BYTES}",
                info.name,
                info.max_smem_per_block_optin
            );
            for kernel in [
                &k.moe_grouped_gemm_sm90,
                &k.moe_grouped_gemm_silu_sm90,
                &k.moe_grouped_gemm_sm90_n128,
                &k.moe_grouped_gemm_silu_sm90_n128,
            ] {
                kernel.set_max_dynamic_smem(GROUPED_SM90_SMEM_BYTES)?;
            }
        }
        Ok(k)
    }
}

/// Grid size for grid-stride kernels: enough blocks to fill the GPU, no more than the work.
pub(crate) fn grid_for(k: &Kernels, work: usize, block: usize) -> u32 {
    (work.div_ceil(block)).clamp(1, k.sm_count * 8) as u32
}

macro_rules! ensure_len {
    ($slice:expr, $need:expr, $what:expr) => {
        let need: usize = $need;
        anyhow::ensure!($slice.len >= need, "{}: buffer holds {} elements, {} needed", $what, $slice.len, need)
    };
}
pub(crate) use ensure_len;
