//! kernels/attention_prefill*.cu and attention_decode.cu: the two MLA attention paths. Their tile
//! shapes are fixed at the dimensions every published DeepSeek model uses (kv_lora_rank 512,
//! qk_rope 64, qk_nope 128, v_head 128); the backend rejects other configs up front.

use super::dims::{
    COMBINE_ABSORB_DIMS, COMBINE_ABSORB_MAX_BATCH, DECODE_HEAD_TILE, DECODE_SMEM_BYTES_4W, DECODE_SMEM_BYTES_8W,
    DECODE_SMEM_BYTES_FP8_4W, DECODE_SMEM_BYTES_FP8_8W, LATENT, NOPE, PREFILL_SM90_SMEM_BYTES, PREFILL_SMEM_BYTES,
    ROPE, V_HEAD,
};
use super::latent::{row_bytes, LatentCacheSlice};
use super::{ensure_len, ensure_smem, Linear};
use crate::gpu::{Arg, DSlice, GpuInfo, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;

pub struct AttentionKernels {
    prefill_mma: Kernel,
    /// Present on compute capability 9.0 (the sm_90a cubin), where it is the default.
    prefill_wgmma: Option<Kernel>,
    decode_4w: Kernel,
    decode_8w: Kernel,
    /// The same two over an FP8 latent cache.
    decode_fp8_4w: Kernel,
    decode_fp8_8w: Kernel,
    combine: Kernel,
    combine_absorb_o: Kernel,
    sm_count: usize,
}

/// The two implementations of decode attention (same function, same arguments; both on every GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeKernel {
    /// Four warps, QKᵀ split over the 576 dims: batches 2-31 and over 64 (run S8: 1-7% ahead at
    /// 2 and 4, level to 5% ahead at 128, level at 256).
    FourWarps,
    /// Eight warps, QKᵀ over 2 dim halves x 4 key groups: batch 1 and 32-64 (run S8: -1% at 1,
    /// -2% at 32 and 64).
    EightWarps,
}

impl DecodeKernel {
    pub const ALL: [DecodeKernel; 2] = [DecodeKernel::FourWarps, DecodeKernel::EightWarps];

    /// The faster one for `batch` requests over a bf16 cache.
    pub fn for_batch(batch: usize) -> DecodeKernel {
        if batch == 1 || (32..=64).contains(&batch) {
            DecodeKernel::EightWarps
        } else {
            DecodeKernel::FourWarps
        }
    }

    /// The faster one for `batch` requests over a cache of `dtype`. Over an FP8 cache the
    /// dequantization of each page runs between its load and its MMAs, on the same warps, and
    /// four warps (one per scheduler) cannot hide its latency: eight are 1.2-1.4x faster at every
    /// batch (run F2, H100, docs/performance.md "FP8 latent cache").
    pub fn for_cache(batch: usize, dtype: mla_core::KvCacheDtype) -> DecodeKernel {
        if dtype.is_fp8() {
            DecodeKernel::EightWarps
        } else {
            DecodeKernel::for_batch(batch)
        }
    }
}

/// The two implementations of prefill attention (same function, same arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillKernel {
    /// mma.sync m16n8k16, 64-row blocks: any GPU of compute capability 8.0+.
    MmaSync,
    /// wgmma, 128-row blocks of 384 threads: a cp.async producer warpgroup and two consumer
    /// warpgroups; sm_90a only, the default on compute capability 9.0.
    Wgmma,
}

impl PrefillKernel {
    /// The implementations this GPU can run, the portable one first.
    pub fn available(k: &AttentionKernels) -> Vec<PrefillKernel> {
        match k.prefill_wgmma {
            None => vec![PrefillKernel::MmaSync],
            Some(_) => vec![PrefillKernel::MmaSync, PrefillKernel::Wgmma],
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct PrefillPass {
    /// Continue from the (o, m, l) state a previous pass left.
    pub load_state: bool,
    /// Normalise and write bf16 output (otherwise store the state for the next pass).
    pub last: bool,
}

/// One launch over `tiles` query tiles of up to [`PREFILL_TILE_Q`] rows (kernels/attention_prefill.cu,
/// kernels/attention_prefill_sm90.cu).
pub struct PrefillAttention<'a> {
    pub heads: usize,
    pub q_rows: usize,
    pub q: DSlice<'a, bf16>,
    pub q_stride: usize,
    pub k_rows: usize,
    pub kv: DSlice<'a, bf16>,
    pub kv_stride: usize,
    pub kpe: DSlice<'a, bf16>,
    pub kpe_stride: usize,
    pub out: DSlice<'a, bf16>,
    pub out_stride: usize,
    pub state_o: DSlice<'a, f32>,
    pub state_ml: DSlice<'a, f32>,
    pub tiles: usize,
    pub tile_seq: DSlice<'a, i32>,
    pub tile_q0: DSlice<'a, i32>,
    pub seqs: usize,
    pub cu_q: DSlice<'a, i32>,
    pub q_pos0: DSlice<'a, i32>,
    pub k_row0: DSlice<'a, i32>,
    pub k_pos0: DSlice<'a, i32>,
    pub k_len: DSlice<'a, i32>,
    pub scale: f32,
    pub pass: PrefillPass,
}

pub struct DecodeAttention<'a> {
    pub batch: usize,
    pub heads: usize,
    /// [batch, heads, 576]: absorbed q_lat | roped q_pe.
    pub q: DSlice<'a, bf16>,
    pub cache: LatentCacheSlice<'a>,
    pub block_tables: DSlice<'a, i32>,
    /// One element on the device: the row stride of `block_tables`.
    pub bt_stride: DSlice<'a, i32>,
    pub seq_lens: DSlice<'a, i32>,
    pub num_splits: usize,
    pub out: DSlice<'a, bf16>,
    pub part_o: DSlice<'a, f32>,
    pub part_lse: DSlice<'a, f32>,
    pub scale: f32,
}

impl<'a> DecodeAttention<'a> {
    /// The per-split partials this launch writes (`decode_partials`) or merges (`decode`).
    pub fn partials(&self) -> SplitPartials<'a> {
        SplitPartials {
            part_o: self.part_o,
            part_lse: self.part_lse,
            heads: self.heads,
            num_splits: self.num_splits,
            batch: self.batch,
        }
    }
}

/// Decode attention's per-split partial outputs: what the split merges read.
#[derive(Clone, Copy)]
pub struct SplitPartials<'a> {
    /// [batch, num_splits, heads, 512]
    pub part_o: DSlice<'a, f32>,
    /// [batch, num_splits, heads] (log2 units)
    pub part_lse: DSlice<'a, f32>,
    pub heads: usize,
    pub num_splits: usize,
    pub batch: usize,
}

impl SplitPartials<'_> {
    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!((1..=64).contains(&self.num_splits), "decode splits {} outside 1..=64", self.num_splits);
        ensure_len!(self.part_o, self.batch * self.num_splits * self.heads * LATENT, "split outputs");
        ensure_len!(self.part_lse, self.batch * self.num_splits * self.heads, "split log-sum-exps");
        Ok(())
    }
}

/// Splits of the KV length per request. One block per (request, head tile, split) holds a whole
/// SM (171 KB of shared memory), so splitting only pays while all blocks fit in one wave: the
/// most splits that keep `batch x head tiles x splits` within the SM count (one split once the
/// batch alone fills the GPU), at least two pages per split, at most 64. This also bounds the
/// partial-output workspace by `SMs + batch` rows.
pub fn choose_decode_splits(sms: usize, batch: usize, heads: usize, max_pages: usize) -> usize {
    let per_split = (batch * heads.div_ceil(DECODE_HEAD_TILE)).max(1);
    let max_splits = max_pages.div_ceil(2).clamp(1, 64);
    (sms / per_split).clamp(1, max_splits)
}

impl AttentionKernels {
    pub fn load(m: &Modules, info: &GpuInfo) -> anyhow::Result<Self> {
        let k = |module, name| m.kernel(module, name);
        // The wgmma kernel exists only in the sm_90a cubin, which is what compute capability 9.0
        // loads; every other GPU runs the mma.sync kernel from PTX.
        let prefill_wgmma = if info.compute_capability == (9, 0) {
            ensure_smem(info, PREFILL_SM90_SMEM_BYTES, "the wgmma prefill attention kernel")?;
            let w = k("attention_prefill_sm90", "mla_prefill_attention_sm90")?;
            w.set_max_dynamic_smem(PREFILL_SM90_SMEM_BYTES)?;
            Some(w)
        } else {
            None
        };
        for (bytes, what) in [
            (PREFILL_SMEM_BYTES, "prefill attention"),
            (DECODE_SMEM_BYTES_4W, "decode attention"),
            (DECODE_SMEM_BYTES_FP8_4W, "decode attention over an FP8 cache"),
        ] {
            ensure_smem(info, bytes, what)?;
        }
        let kernels = AttentionKernels {
            prefill_mma: k("attention_prefill", "mla_prefill_attention")?,
            prefill_wgmma,
            // Both decode kernels keep Q in registers and are dispatched by batch size
            // (DecodeKernel::for_cache), on every GPU (cubin and PTX).
            decode_4w: k("attention_decode", "mla_decode_attention_4w")?,
            decode_8w: k("attention_decode", "mla_decode_attention_8w")?,
            decode_fp8_4w: k("attention_decode", "mla_decode_attention_fp8_4w")?,
            decode_fp8_8w: k("attention_decode", "mla_decode_attention_fp8_8w")?,
            combine: k("attention_decode", "mla_decode_combine")?,
            combine_absorb_o: k("attention_decode", "mla_decode_combine_absorb_o")?,
            sm_count: info.sm_count,
        };
        kernels.prefill_mma.set_max_dynamic_smem(PREFILL_SMEM_BYTES)?;
        kernels.decode_4w.set_max_dynamic_smem(DECODE_SMEM_BYTES_4W)?;
        kernels.decode_8w.set_max_dynamic_smem(DECODE_SMEM_BYTES_8W)?;
        kernels.decode_fp8_4w.set_max_dynamic_smem(DECODE_SMEM_BYTES_FP8_4W)?;
        kernels.decode_fp8_8w.set_max_dynamic_smem(DECODE_SMEM_BYTES_FP8_8W)?;
        Ok(kernels)
    }

    /// The prefill kernel this GPU runs by default.
    pub fn default_prefill(&self) -> PrefillKernel {
        if self.prefill_wgmma.is_some() {
            PrefillKernel::Wgmma
        } else {
            PrefillKernel::MmaSync
        }
    }

    pub fn prefill(&self, s: CUstream, p: &PrefillAttention) -> anyhow::Result<()> {
        self.prefill_with(s, p, self.default_prefill())
    }

    /// Prefill attention through a chosen implementation (tests and benchmarks compare both).
    pub fn prefill_with(&self, s: CUstream, p: &PrefillAttention, which: PrefillKernel) -> anyhow::Result<()> {
        let (qd, hd) = (NOPE + ROPE, NOPE + V_HEAD);
        anyhow::ensure!(
            p.q_stride >= p.heads * qd && p.kv_stride >= p.heads * hd && p.out_stride >= p.heads * V_HEAD,
            "prefill attention: row strides too small"
        );
        ensure_len!(p.q, p.q_rows * p.q_stride, "prefill queries");
        ensure_len!(p.out, p.q_rows * p.out_stride, "prefill output");
        ensure_len!(p.kv, p.k_rows * p.kv_stride, "decompressed keys/values");
        if p.k_rows > 0 {
            ensure_len!(p.kpe, (p.k_rows - 1) * p.kpe_stride + ROPE, "k_pe rows");
        }
        if p.pass.load_state || !p.pass.last {
            ensure_len!(p.state_o, p.q_rows * p.heads * V_HEAD, "attention state");
            ensure_len!(p.state_ml, p.q_rows * p.heads * 2, "attention state (m, l)");
        }
        ensure_len!(p.tile_seq, p.tiles, "tile map");
        ensure_len!(p.tile_q0, p.tiles, "tile map");
        ensure_len!(p.cu_q, p.seqs + 1, "query offsets");
        for (b, n) in [
            (p.q_pos0, "query positions"),
            (p.k_row0, "key rows"),
            (p.k_pos0, "key positions"),
            (p.k_len, "key counts"),
        ] {
            ensure_len!(b, p.seqs, n);
        }
        let flags = (p.pass.load_state as i32) | ((p.pass.last as i32) << 1);
        let scale_log2 = p.scale * std::f32::consts::LOG2_E;
        let (kernel, grid, threads, smem) = match which {
            PrefillKernel::MmaSync => {
                (&self.prefill_mma, (2 * p.tiles as u32, p.heads as u32, 1), 128, PREFILL_SMEM_BYTES)
            }
            PrefillKernel::Wgmma => {
                // The wgmma kernel is in the sm_90a cubin only.
                let k = self.prefill_wgmma.as_ref().ok_or_else(|| {
                    anyhow::anyhow!("the wgmma prefill attention kernel needs compute capability 9.0")
                })?;
                (k, (p.tiles as u32, p.heads as u32, 1), 384, PREFILL_SM90_SMEM_BYTES)
            }
        };
        kernel.launch(
            s,
            grid,
            threads,
            smem as u32,
            &[
                Arg::Ptr(p.q.ptr),
                Arg::I32(p.q_stride as i32),
                Arg::Ptr(p.kv.ptr),
                Arg::I32(p.kv_stride as i32),
                Arg::Ptr(p.kpe.ptr),
                Arg::I32(p.kpe_stride as i32),
                Arg::Ptr(p.out.ptr),
                Arg::I32(p.out_stride as i32),
                Arg::Ptr(p.state_o.ptr),
                Arg::Ptr(p.state_ml.ptr),
                Arg::Ptr(p.tile_seq.ptr),
                Arg::Ptr(p.tile_q0.ptr),
                Arg::Ptr(p.cu_q.ptr),
                Arg::Ptr(p.q_pos0.ptr),
                Arg::Ptr(p.k_row0.ptr),
                Arg::Ptr(p.k_pos0.ptr),
                Arg::Ptr(p.k_len.ptr),
                Arg::I32(p.heads as i32),
                Arg::F32(scale_log2),
                Arg::I32(flags),
            ],
        )?;
        Ok(())
    }

    /// Splits of the KV length per request for this GPU (see [`choose_decode_splits`]).
    pub fn splits(&self, batch: usize, heads: usize, max_pages: usize) -> usize {
        choose_decode_splits(self.sm_count, batch, heads, max_pages)
    }

    /// Decode attention (kernels/attention_decode.cu) through the kernel for this batch size
    /// and cache ([`DecodeKernel::for_cache`]), merging the splits into `out`.
    pub fn decode(&self, s: CUstream, p: &DecodeAttention) -> anyhow::Result<()> {
        self.decode_with(s, p, DecodeKernel::for_cache(p.batch, p.cache.dtype))
    }

    /// Decode attention through a chosen implementation (tests and benchmarks compare both).
    pub fn decode_with(&self, s: CUstream, p: &DecodeAttention, which: DecodeKernel) -> anyhow::Result<()> {
        self.decode_launch(s, p, which, p.num_splits == 1)?;
        if p.num_splits > 1 {
            self.combine(s, &p.partials(), p.out)?;
        }
        Ok(())
    }

    /// Merges the per-split partials into o_lat `out` ([batch, heads, 512] bf16).
    pub fn combine(&self, s: CUstream, p: &SplitPartials, out: DSlice<bf16>) -> anyhow::Result<()> {
        p.check()?;
        ensure_len!(out, p.batch * p.heads * LATENT, "decode output");
        self.combine.launch(
            s,
            (p.heads as u32, p.batch as u32, (LATENT / 128) as u32),
            128,
            0,
            &[
                Arg::Ptr(p.part_o.ptr),
                Arg::Ptr(p.part_lse.ptr),
                Arg::I32(p.heads as i32),
                Arg::I32(p.num_splits as i32),
                Arg::Ptr(out.ptr),
            ],
        )?;
        Ok(())
    }

    /// The attention kernel alone, writing the per-split partials (`part_o`, `part_lse`) even for
    /// one split and leaving `out` untouched: the first half of a small decode step whose second is
    /// [`AttentionKernels::decode_combine_absorb_o`].
    pub fn decode_partials(&self, s: CUstream, p: &DecodeAttention) -> anyhow::Result<()> {
        self.decode_launch(s, p, DecodeKernel::for_cache(p.batch, p.cache.dtype), false)
    }

    fn decode_launch(
        &self,
        s: CUstream,
        p: &DecodeAttention,
        which: DecodeKernel,
        write_out: bool,
    ) -> anyhow::Result<()> {
        let d = LATENT + ROPE;
        ensure_len!(p.q, p.batch * p.heads * d, "decode queries");
        let rb = row_bytes(p.cache.dtype);
        anyhow::ensure!(
            p.cache.bytes.len.is_multiple_of(rb),
            "latent cache of {} bytes is not a whole number of {rb}-byte rows",
            p.cache.bytes.len
        );
        ensure_len!(p.bt_stride, 1, "block-table stride");
        ensure_len!(p.seq_lens, p.batch, "sequence lengths");
        anyhow::ensure!((1..=64).contains(&p.num_splits), "decode splits {} outside 1..=64", p.num_splits);
        if write_out {
            ensure_len!(p.out, p.batch * p.heads * LATENT, "decode output");
        }
        if p.num_splits > 1 || !write_out {
            ensure_len!(p.part_o, p.batch * p.num_splits * p.heads * LATENT, "split outputs");
            ensure_len!(p.part_lse, p.batch * p.num_splits * p.heads, "split log-sum-exps");
        }
        let scale_log2 = p.scale * std::f32::consts::LOG2_E;
        let grid = (p.num_splits as u32, p.heads.div_ceil(DECODE_HEAD_TILE) as u32, p.batch as u32);
        let (kernel, threads, smem) = match (which, p.cache.is_fp8()) {
            (DecodeKernel::FourWarps, false) => (&self.decode_4w, 128, DECODE_SMEM_BYTES_4W),
            (DecodeKernel::EightWarps, false) => (&self.decode_8w, 256, DECODE_SMEM_BYTES_8W),
            (DecodeKernel::FourWarps, true) => (&self.decode_fp8_4w, 128, DECODE_SMEM_BYTES_FP8_4W),
            (DecodeKernel::EightWarps, true) => (&self.decode_fp8_8w, 256, DECODE_SMEM_BYTES_FP8_8W),
        };
        kernel.launch(
            s,
            grid,
            threads,
            smem as u32,
            &[
                Arg::Ptr(p.q.ptr),
                Arg::I32((p.heads * d) as i32),
                Arg::Ptr(p.cache.ptr()),
                Arg::Ptr(p.block_tables.ptr),
                Arg::Ptr(p.bt_stride.ptr),
                Arg::Ptr(p.seq_lens.ptr),
                Arg::I32(p.heads as i32),
                Arg::F32(scale_log2),
                Arg::I32(p.num_splits as i32),
                // A null output makes the kernel write the partials.
                Arg::Ptr(if write_out { p.out.ptr } else { 0 }),
                Arg::Ptr(p.part_o.ptr),
                Arg::Ptr(p.part_lse.ptr),
            ],
        )?;
        Ok(())
    }

    /// For decode steps of 1 to [`COMBINE_ABSORB_MAX_BATCH`] tokens, in one launch: the merge of
    /// [`AttentionKernels::decode_partials`]' splits into o_lat (rounded to bf16 as
    /// `decode` writes it) and [`crate::gpu::Blas::absorb_o`] of it: `out[b, h * 128 + d] =
    /// Σ_c W_UV[h][d][c] · o_lat[b, h, c]` ([batch, heads * 128] bf16), `kv_b` = kv_b_proj
    /// [heads * 256, 512]. W_UV is loaded before the PDL wait.
    pub fn decode_combine_absorb_o(
        &self,
        s: CUstream,
        p: &SplitPartials,
        kv_b: &Linear,
        out: DSlice<bf16>,
    ) -> anyhow::Result<()> {
        let (heads, num_splits, batch, part_o, part_lse) = (p.heads, p.num_splits, p.batch, p.part_o, p.part_lse);
        anyhow::ensure!(
            (1..=COMBINE_ABSORB_MAX_BATCH).contains(&batch),
            "combine + absorb_o takes 1..={COMBINE_ABSORB_MAX_BATCH} tokens, not {batch}"
        );
        p.check()?;
        anyhow::ensure!(
            kv_b.out == heads * (NOPE + V_HEAD) && kv_b.inp == LATENT,
            "kv_b_proj is [{}, {}]",
            kv_b.out,
            kv_b.inp
        );
        ensure_len!(out, batch * heads * V_HEAD, "attention output");
        self.combine_absorb_o.launch(
            s,
            ((V_HEAD / COMBINE_ABSORB_DIMS) as u32, heads as u32, 1),
            256,
            0,
            &[
                Arg::Ptr(part_o.ptr),
                Arg::Ptr(part_lse.ptr),
                Arg::I32(heads as i32),
                Arg::I32(num_splits as i32),
                Arg::I32(batch as i32),
                Arg::Ptr(kv_b.w.ptr),
                Arg::Ptr(out.ptr),
            ],
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::choose_decode_splits;

    #[test]
    fn splits_fill_whole_waves_of_an_h200() {
        // 132 SMs, 16 heads (one head tile), 4096-token contexts (64 pages, up to 32 splits).
        assert_eq!(choose_decode_splits(132, 1, 16, 64), 32); // one request: as many as allowed
        assert_eq!(choose_decode_splits(132, 32, 16, 64), 4); // 128 blocks: one 97% wave, not 160
        assert_eq!(choose_decode_splits(132, 64, 16, 64), 2);
        assert_eq!(choose_decode_splits(132, 128, 16, 64), 1);
        assert_eq!(choose_decode_splits(132, 256, 16, 64), 1); // never more waves than needed
        assert_eq!(choose_decode_splits(132, 64, 16, 65), 2);
        // Short contexts cap the splits at one per two pages.
        assert_eq!(choose_decode_splits(132, 1, 16, 3), 2);
        // 128 heads = 8 head tiles per request.
        assert_eq!(choose_decode_splits(132, 16, 128, 64), 1);
    }
}
