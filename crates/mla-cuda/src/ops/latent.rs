//! kernels/latent_cache.cu: kv_a_layernorm + RoPE + the latent-cache write (bf16 or FP8 rows),
//! fused with RoPE of the queries and, for small decode steps, their absorption into latent
//! space; and the gather of FP8 rows as bf16 for prefill.

use super::dims::{LATENT, LATENT_FP8_ROW_BYTES, LATENT_ROW, NOPE, ROPE_ABSORB_THREADS};
use super::ensure_len;
use crate::gpu::{Arg, DSlice, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;
use mla_core::KvCacheDtype;

pub struct LatentKernels {
    rope_cache: Kernel,
    rope_absorb_q: Kernel,
    gather_fp8: Kernel,
    fill_fp8: Kernel,
    sm_count: usize,
}

/// One layer's paged latent cache on the device: rows of `[c_kv ; k_pe]` in bf16, or the FP8 rows
/// of `mla_core::model::latent_fp8` (dims.cuh's LATENT_FP8_ROW_BYTES each).
#[derive(Clone, Copy)]
pub struct LatentCacheSlice<'a> {
    pub bytes: DSlice<'a, u8>,
    pub dtype: KvCacheDtype,
}

impl<'a> LatentCacheSlice<'a> {
    pub fn is_fp8(&self) -> bool {
        self.dtype.is_fp8()
    }

    /// Rows (token slots) the slice holds.
    pub fn rows(&self) -> usize {
        self.bytes.len / row_bytes(self.dtype)
    }

    pub fn ptr(&self) -> u64 {
        self.bytes.ptr
    }
}

/// A bf16 cache (tests and benchmarks that build one by hand).
impl<'a> From<DSlice<'a, bf16>> for LatentCacheSlice<'a> {
    fn from(s: DSlice<'a, bf16>) -> Self {
        // SAFETY: the same bytes, seen as bytes.
        LatentCacheSlice { bytes: unsafe { s.reinterpret(s.len * 2) }, dtype: KvCacheDtype::Auto }
    }
}

/// Bytes of one cached token of one layer on the device.
pub fn row_bytes(dtype: KvCacheDtype) -> usize {
    match dtype {
        KvCacheDtype::Auto => LATENT_ROW * std::mem::size_of::<bf16>(),
        KvCacheDtype::Fp8E4m3 => LATENT_FP8_ROW_BYTES,
    }
}

/// One launch of `mla_rope_cache` for `tokens` fed tokens.
pub struct RopeCache<'a> {
    pub tokens: usize,
    pub heads: usize,
    pub nope: usize,
    pub kv_lora_rank: usize,
    pub rope_dim: usize,
    /// Output of kv_a_proj_with_mqa: rows of `kv_lora_rank + rope_dim` at `kva_stride`.
    pub kva: DSlice<'a, bf16>,
    pub kva_stride: usize,
    pub kv_norm_w: DSlice<'a, bf16>,
    /// Queries, rows of `heads * (nope + rope_dim)` at `q_stride`; q_pe is rotated in place.
    pub q: DSlice<'a, bf16>,
    pub q_stride: usize,
    /// Optional second destination of the rotated q_pe: (buffer, row stride, head stride).
    pub q_pe_out: Option<(DSlice<'a, bf16>, usize, usize)>,
    pub positions: DSlice<'a, i32>,
    /// Cache slot of each token; negative skips the write.
    pub slots: DSlice<'a, i32>,
    pub inv_freq: DSlice<'a, f32>,
    pub attn_factor: f32,
    pub eps: f32,
    pub cache: LatentCacheSlice<'a>,
    /// Decode steps of a few tokens: also absorb the queries in the same launch.
    pub absorb: Option<AbsorbQ<'a>>,
}

/// `q_abs[t, h, :512] = W_UK[h]ᵀ · q_nope[t, h]` done by `mla_rope_absorb_q` (as `Blas::absorb_q`).
pub struct AbsorbQ<'a> {
    /// kv_b_proj, [heads * (nope + v_dim), kv_lora_rank].
    pub kv_b: DSlice<'a, bf16>,
    pub v_dim: usize,
    /// Destination rows (stride, head stride); its first kv_lora_rank values per head.
    pub q_abs: DSlice<'a, bf16>,
    pub row_stride: usize,
    pub head_stride: usize,
}

impl LatentKernels {
    pub fn load(m: &Modules, sm_count: usize) -> anyhow::Result<Self> {
        Ok(LatentKernels {
            rope_cache: m.kernel("latent_cache", "mla_rope_cache")?,
            rope_absorb_q: m.kernel("latent_cache", "mla_rope_absorb_q")?,
            gather_fp8: m.kernel("latent_cache", "gather_latent_fp8")?,
            fill_fp8: m.kernel("latent_cache", "fill_latent_fp8_random")?,
            sm_count,
        })
    }

    /// Fills an FP8 cache with valid rows of pseudo-random codes and scale 2^-7 (benchmarks and
    /// dummy-weight runs, where a bf16 cache is drawn from N(0, 1)).
    pub fn fill_fp8_random(&self, s: CUstream, cache: LatentCacheSlice, seed: u64) -> anyhow::Result<()> {
        anyhow::ensure!(cache.is_fp8(), "fill_latent_fp8_random writes an FP8 cache");
        let blocks = (self.sm_count * 8) as u32;
        self.fill_fp8.launch(
            s,
            (blocks, 1, 1),
            256,
            0,
            &[Arg::Ptr(cache.ptr()), Arg::I64(cache.rows() as i64), Arg::U64(seed)],
        )?;
        Ok(())
    }

    /// `out[i] = the bf16 values of FP8 cache row slots[i]` for `rows` rows of 576 (exact).
    pub fn gather_fp8(
        &self,
        s: CUstream,
        cache: LatentCacheSlice,
        slots: DSlice<i32>,
        out: DSlice<bf16>,
        rows: usize,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(cache.is_fp8(), "gather_latent_fp8 reads an FP8 cache");
        ensure_len!(slots, rows, "slots");
        ensure_len!(out, rows * LATENT_ROW, "gathered latents");
        if rows == 0 {
            return Ok(());
        }
        let work = rows * (LATENT_ROW / 8);
        let blocks = work.div_ceil(256).min(self.sm_count * 8) as u32;
        self.gather_fp8.launch(
            s,
            (blocks, 1, 1),
            256,
            0,
            &[Arg::Ptr(cache.ptr()), Arg::Ptr(slots.ptr), Arg::Ptr(out.ptr), Arg::I32(rows as i32)],
        )?;
        Ok(())
    }

    pub fn rope_cache(&self, s: CUstream, p: &RopeCache) -> anyhow::Result<()> {
        let (t, w) = (p.tokens, p.kv_lora_rank + p.rope_dim);
        anyhow::ensure!(
            p.rope_dim.is_multiple_of(2) && p.rope_dim <= 128,
            "rope dim {} must be even and at most 128",
            p.rope_dim
        );
        if t == 0 {
            return Ok(());
        }
        ensure_len!(p.kva, (t - 1) * p.kva_stride + w, "kv_a output");
        ensure_len!(p.kv_norm_w, p.kv_lora_rank, "kv_a_layernorm weight");
        ensure_len!(p.q, (t - 1) * p.q_stride + p.heads * (p.nope + p.rope_dim), "queries");
        ensure_len!(p.positions, t, "positions");
        ensure_len!(p.slots, t, "slot mapping");
        ensure_len!(p.inv_freq, p.rope_dim / 2, "inverse frequencies");
        let rb = row_bytes(p.cache.dtype);
        anyhow::ensure!(
            p.cache.bytes.len.is_multiple_of(rb),
            "cache of {} bytes is not a whole number of {rb}-byte rows",
            p.cache.bytes.len
        );
        anyhow::ensure!(
            p.cache.dtype == KvCacheDtype::Auto || w == LATENT_ROW,
            "an FP8 cache holds rows of {LATENT_ROW} values, not {w}"
        );
        let (qo, qo_stride, qo_head) = match p.q_pe_out {
            Some((b, rs, hs)) => {
                ensure_len!(b, (t - 1) * rs + (p.heads - 1) * hs + p.rope_dim, "q_pe destination");
                (b.ptr, rs, hs)
            }
            None => (0, 0, 0),
        };
        let mut args = vec![
            Arg::Ptr(p.kva.ptr),
            Arg::I32(p.kva_stride as i32),
            Arg::Ptr(p.kv_norm_w.ptr),
            Arg::Ptr(p.q.ptr),
            Arg::I32(p.q_stride as i32),
            Arg::Ptr(qo),
            Arg::I32(qo_stride as i32),
            Arg::I32(qo_head as i32),
            Arg::Ptr(p.positions.ptr),
            Arg::Ptr(p.slots.ptr),
            Arg::Ptr(p.inv_freq.ptr),
            Arg::F32(p.attn_factor),
            Arg::F32(p.eps),
            Arg::Ptr(p.cache.ptr()),
            Arg::I32(p.cache.is_fp8() as i32),
            Arg::I32(p.heads as i32),
            Arg::I32(p.nope as i32),
            Arg::I32(p.kv_lora_rank as i32),
            Arg::I32(p.rope_dim as i32),
        ];
        let Some(a) = &p.absorb else {
            self.rope_cache.launch(s, (t as u32, 1, 1), 128, 0, &args)?;
            return Ok(());
        };
        anyhow::ensure!(
            p.nope == NOPE && p.kv_lora_rank == LATENT,
            "mla_rope_absorb_q is built for nope {NOPE} and kv_lora_rank {LATENT}"
        );
        ensure_len!(a.kv_b, p.heads * (p.nope + a.v_dim) * p.kv_lora_rank, "kv_b_proj");
        ensure_len!(
            a.q_abs,
            (t - 1) * a.row_stride + (p.heads - 1) * a.head_stride + p.kv_lora_rank,
            "absorbed queries"
        );
        args.extend([
            Arg::Ptr(a.kv_b.ptr),
            Arg::I32(a.v_dim as i32),
            Arg::Ptr(a.q_abs.ptr),
            Arg::I32(a.row_stride as i32),
            Arg::I32(a.head_stride as i32),
        ]);
        self.rope_absorb_q.launch(s, (p.heads as u32 + 1, t as u32, 1), ROPE_ABSORB_THREADS as u32, 0, &args)?;
        Ok(())
    }
}
