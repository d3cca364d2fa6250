//! Wrappers of the two MLA attention kernels. Their tile shapes are fixed at the dimensions every
//! published DeepSeek model uses (kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128); the
//! backend rejects other configs up front.

use super::{ensure_len, Kernels, Linear};
use crate::gpu::{Arg, DSlice};
use cudarc::driver::sys::CUstream;
use half::bf16;

pub const PAGE_SIZE: usize = 64;
pub const DECODE_HEAD_TILE: usize = 16;
pub const NOPE: usize = 128;
pub const ROPE: usize = 64;
pub const V_HEAD: usize = 128;
pub const LATENT: usize = 512;
/// Query rows per entry of the prefill tile map: one block of the wgmma kernel, two of the
/// mma.sync kernel (64 rows each).
pub const PREFILL_TILE_Q: usize = 128;

// Must match the kernels' shared-memory layout (see the comments next to the kernels).
pub(crate) const PREFILL_SMEM_BYTES: usize = (64 * 200 + 2 * 64 * 200 + 2 * 64 * 136) * 2;
/// Q [128 x 192] + 2 x (K [128 x 192] + V [128 x 128]) bf16 + 2048 bytes: the 1024-byte
/// alignment and the mbarriers (kernels/attention_prefill_sm90.cu).
pub(crate) const PREFILL_SM90_SMEM_BYTES: usize = (128 * 192 + 2 * (128 * 192 + 128 * 128)) * 2 + 2048;
/// Q + two pages + P tile, bf16; per-warp max/sum scratch; the partial-S exchange across the warps
/// (4 warps x 8 key tiles or 8 warps x 2 key tiles, 32 lanes x float4).
const fn decode_smem_bytes(warps: usize) -> usize {
    (16 * 584 + 2 * 64 * 584 + 16 * 72) * 2 + 2 * warps * 16 * 4 + warps * (if warps == 4 { 8 } else { 2 }) * 32 * 16
}
/// The four-warp decode kernel's; the eight-warp kernel needs less.
pub(crate) const DECODE_SMEM_BYTES: usize = decode_smem_bytes(4);
pub(crate) const DECODE_W8_SMEM_BYTES: usize = decode_smem_bytes(8);
/// Largest batch of [`Kernels::decode_combine_absorb_o`].
pub const COMBINE_ABSORB_MAX_BATCH: usize = 4;
/// Output dims per block of `mla_decode_combine_absorb_o` (`absorb::DQ` in the kernel).
const COMBINE_ABSORB_DIMS: usize = 32;

/// The two implementations of decode attention (same function, same arguments; both on every GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeKernel {
    /// Four warps, QKᵀ split over the 576 dims: batches 2-31 and over 64 (run S2: 1-7% ahead at
    /// 2 and 4, level to 5% ahead at 128, level at 256).
    FourWarps,
    /// Eight warps, QKᵀ over 2 dim halves x 4 key groups: batch 1 and 32-64 (run S2: -1% at 1,
    /// -2% at 32 and 64).
    EightWarps,
}

impl DecodeKernel {
    pub const ALL: [DecodeKernel; 2] = [DecodeKernel::FourWarps, DecodeKernel::EightWarps];

    /// The faster one for `batch` requests.
    pub fn for_batch(batch: usize) -> DecodeKernel {
        if batch == 1 || (32..=64).contains(&batch) {
            DecodeKernel::EightWarps
        } else {
            DecodeKernel::FourWarps
        }
    }
}

/// The two implementations of prefill attention (same function, same arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillKernel {
    /// mma.sync m16n8k16, 64-row blocks: any GPU of compute capability 8.0+.
    MmaSync,
    /// wgmma, 128-row blocks of 384 threads: a cp.async producer warpgroup and two consumer
    /// warpgroups (the name is that of the lockstep kernel it replaced): sm_90a only; the default
    /// on compute capability 9.0.
    WgmmaLockstep,
}

impl PrefillKernel {
    /// The implementations this GPU can run, the portable one first.
    pub fn available(k: &Kernels) -> Vec<PrefillKernel> {
        match k.prefill_kernel {
            PrefillKernel::MmaSync => vec![PrefillKernel::MmaSync],
            PrefillKernel::WgmmaLockstep => vec![PrefillKernel::MmaSync, PrefillKernel::WgmmaLockstep],
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
pub struct PrefillAttention {
    pub heads: usize,
    pub q_rows: usize,
    pub q: DSlice<bf16>,
    pub q_stride: usize,
    pub k_rows: usize,
    pub kv: DSlice<bf16>,
    pub kv_stride: usize,
    pub kpe: DSlice<bf16>,
    pub kpe_stride: usize,
    pub out: DSlice<bf16>,
    pub out_stride: usize,
    pub state_o: DSlice<f32>,
    pub state_ml: DSlice<f32>,
    pub tiles: usize,
    pub tile_seq: DSlice<i32>,
    pub tile_q0: DSlice<i32>,
    pub seqs: usize,
    pub cu_q: DSlice<i32>,
    pub q_pos0: DSlice<i32>,
    pub k_row0: DSlice<i32>,
    pub k_pos0: DSlice<i32>,
    pub k_len: DSlice<i32>,
    pub scale: f32,
    pub pass: PrefillPass,
}

pub struct DecodeAttention {
    pub batch: usize,
    pub heads: usize,
    /// [batch, heads, 576]: absorbed q_lat | roped q_pe.
    pub q: DSlice<bf16>,
    pub cache: DSlice<bf16>,
    pub block_tables: DSlice<i32>,
    /// One element on the device: the row stride of `block_tables`.
    pub bt_stride: DSlice<i32>,
    pub seq_lens: DSlice<i32>,
    pub num_splits: usize,
    pub out: DSlice<bf16>,
    pub part_o: DSlice<f32>,
    pub part_lse: DSlice<f32>,
    pub scale: f32,
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

impl Kernels {
    pub fn prefill_attention(&self, s: CUstream, p: &PrefillAttention) -> anyhow::Result<()> {
        self.prefill_attention_with(s, p, self.prefill_kernel)
    }

    /// Prefill attention through a chosen implementation (tests and benchmarks compare both).
    pub fn prefill_attention_with(
        &self,
        s: CUstream,
        p: &PrefillAttention,
        which: PrefillKernel,
    ) -> anyhow::Result<()> {
        // The wgmma kernel is in the sm_90a cubin only (the default is MmaSync everywhere else).
        anyhow::ensure!(
            which == PrefillKernel::MmaSync || self.prefill_kernel != PrefillKernel::MmaSync,
            "the wgmma prefill attention kernel needs compute capability 9.0"
        );
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
                (&self.mla_prefill_attention, (2 * p.tiles as u32, p.heads as u32, 1), 128, PREFILL_SMEM_BYTES)
            }
            PrefillKernel::WgmmaLockstep => (
                &self.mla_prefill_attention_sm90_sync,
                (p.tiles as u32, p.heads as u32, 1),
                384,
                PREFILL_SM90_SMEM_BYTES,
            ),
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
    pub fn decode_splits(&self, batch: usize, heads: usize, max_pages: usize) -> usize {
        choose_decode_splits(self.sm_count, batch, heads, max_pages)
    }

    /// Decode attention (kernels/attention_decode.cu) through the kernel for this batch size
    /// ([`DecodeKernel::for_batch`]), merging the splits into `out`.
    pub fn decode_attention(&self, s: CUstream, p: &DecodeAttention) -> anyhow::Result<()> {
        self.decode_attention_with(s, p, DecodeKernel::for_batch(p.batch))
    }

    /// Decode attention through a chosen implementation (tests and benchmarks compare both).
    pub fn decode_attention_with(&self, s: CUstream, p: &DecodeAttention, which: DecodeKernel) -> anyhow::Result<()> {
        self.decode_attention_launch(s, p, which, p.num_splits == 1)?;
        if p.num_splits > 1 {
            self.mla_decode_combine.launch(
                s,
                (p.heads as u32, p.batch as u32, (LATENT / 128) as u32),
                128,
                0,
                &[
                    Arg::Ptr(p.part_o.ptr),
                    Arg::Ptr(p.part_lse.ptr),
                    Arg::I32(p.heads as i32),
                    Arg::I32(p.num_splits as i32),
                    Arg::Ptr(p.out.ptr),
                ],
            )?;
        }
        Ok(())
    }

    /// The attention kernel alone, writing the per-split partials (`part_o`, `part_lse`) even for
    /// one split and leaving `out` untouched: the first half of a small decode step whose second is
    /// [`Kernels::decode_combine_absorb_o`].
    pub fn decode_attention_partials(&self, s: CUstream, p: &DecodeAttention) -> anyhow::Result<()> {
        self.decode_attention_launch(s, p, DecodeKernel::for_batch(p.batch), false)
    }

    fn decode_attention_launch(
        &self,
        s: CUstream,
        p: &DecodeAttention,
        which: DecodeKernel,
        write_out: bool,
    ) -> anyhow::Result<()> {
        let d = LATENT + ROPE;
        ensure_len!(p.q, p.batch * p.heads * d, "decode queries");
        anyhow::ensure!(p.cache.len.is_multiple_of(d), "latent cache length {} is not a multiple of {d}", p.cache.len);
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
        let (kernel, threads, smem) = match which {
            DecodeKernel::FourWarps => (&self.mla_decode_attention_qregs, 128, DECODE_SMEM_BYTES),
            DecodeKernel::EightWarps => (&self.mla_decode_attention_w8, 256, DECODE_W8_SMEM_BYTES),
        };
        kernel.launch(
            s,
            grid,
            threads,
            smem as u32,
            &[
                Arg::Ptr(p.q.ptr),
                Arg::I32((p.heads * d) as i32),
                Arg::Ptr(p.cache.ptr),
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
    /// [`Kernels::decode_attention_partials`]' splits into o_lat (rounded to bf16 as
    /// `decode_attention` writes it) and [`crate::gpu::Blas::absorb_o`] of it: `out[b, h * 128 + d]
    /// = Σ_c W_UV[h][d][c] · o_lat[b, h, c]` ([batch, heads * 128] bf16), `kv_b` = kv_b_proj
    /// [heads * 256, 512]. W_UV is loaded before the PDL wait.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_combine_absorb_o(
        &self,
        s: CUstream,
        part_o: DSlice<f32>,
        part_lse: DSlice<f32>,
        heads: usize,
        num_splits: usize,
        batch: usize,
        kv_b: &Linear,
        out: DSlice<bf16>,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            (1..=COMBINE_ABSORB_MAX_BATCH).contains(&batch),
            "combine + absorb_o takes 1..={COMBINE_ABSORB_MAX_BATCH} tokens, not {batch}"
        );
        anyhow::ensure!((1..=64).contains(&num_splits), "decode splits {num_splits} outside 1..=64");
        anyhow::ensure!(
            kv_b.out == heads * (NOPE + V_HEAD) && kv_b.inp == LATENT,
            "kv_b_proj is [{}, {}]",
            kv_b.out,
            kv_b.inp
        );
        ensure_len!(part_o, batch * num_splits * heads * LATENT, "split outputs");
        ensure_len!(part_lse, batch * num_splits * heads, "split log-sum-exps");
        ensure_len!(out, batch * heads * V_HEAD, "attention output");
        self.mla_decode_combine_absorb_o.launch(
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
