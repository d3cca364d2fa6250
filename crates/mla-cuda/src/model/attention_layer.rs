//! One layer's MLA attention on the device: the query and latent projections, RoPE and the cache
//! write, then the normal (decompressed) path for the prompt chunks and the absorbed path over the
//! latent cache for the decode rows (a mixed step runs both, each over its own rows), and the
//! output projection over every row.

use super::forward::{rows, CudaModel};
use super::meta::{DecodeLayout, PrefillLayout, StepMeta};
use super::weights::{LayerWeights, QueryWeights};
use crate::device::Device;
use crate::gpu::DSlice;
use crate::ops::{
    AbsorbQ, DecodeAttention, LatentCacheSlice, Linear, PrefillAttention, PrefillPass, RmsNormBf16, RopeCache,
    COMBINE_ABSORB_MAX_BATCH, LATENT, NOPE, ROPE, V_HEAD,
};
use half::bf16;
use std::ops::Range;

/// Steps of at most this many decode rows absorb their queries inside the rope/cache launch
/// (one launch instead of two; the cuBLAS batched GEMM wins beyond a few rows).
const SMALL_DECODE_TOKENS: usize = 4;

/// What both attention paths of one layer read besides the activations.
struct LayerAttention<'a> {
    /// The layer's slice of the latent cache.
    cache: LatentCacheSlice<'a>,
    kv_a_norm: DSlice<'a, bf16>,
    kv_b: Linear<'a>,
    /// The step's metadata on the device.
    words: DSlice<'a, i32>,
}

impl CudaModel {
    /// Layer `lw`'s attention, over cache layer `l` (a main layer's own index, or the MTP
    /// module's layer after them).
    pub(super) fn attention(
        &self,
        dev: &Device,
        lw: &LayerWeights,
        l: usize,
        m: &StepMeta,
        words: DSlice<i32>,
        decode_splits: usize,
    ) -> anyhow::Result<()> {
        let (s, k) = (dev.stream(), &dev.k);
        let cfg = &self.cfg;
        let ws = &self.ws;
        let (t, hidden, heads) = (m.tokens, cfg.hidden_size, cfg.num_attention_heads);
        let (qd, lat) = (NOPE + ROPE, LATENT + ROPE);
        let h = rows(&ws.h, hidden);
        // q (or q_a) and kv_a both read h: one launch at small batch.
        let kv_a = lw.kv_a.proj();
        match &lw.query {
            QueryWeights::Direct(q) => self.linears.linear_pair(
                dev,
                h,
                t,
                (&q.proj(), rows(&ws.q, heads * qd)),
                (&kv_a, rows(&ws.kva, lat)),
            )?,
            QueryWeights::LowRank { a, a_norm, b } => {
                let r = a.out;
                self.linears.linear_pair(dev, h, t, (&a.proj(), rows(&ws.q_a, r)), (&kv_a, rows(&ws.kva, lat)))?;
                let norm = RmsNormBf16 {
                    x: ws.q_a.slice(),
                    x_stride: r,
                    weight: a_norm.slice(),
                    out: ws.q_a_normed.slice(),
                    out_stride: r,
                    rows: t,
                    width: r,
                    eps: self.eps,
                };
                k.elementwise.rmsnorm_bf16(s, &norm)?;
                self.linears.linear(dev, &b.proj(), rows(&ws.q_a_normed, r), t, rows(&ws.q, heads * qd))?;
            }
        }
        let layer =
            LayerAttention { cache: self.layer_cache(l), kv_a_norm: lw.kv_a_norm.slice(), kv_b: lw.kv_b.lin(), words };
        // A mixed step queues the cache writes of all its rows before either path reads the
        // cache, as a step of one kind does.
        if let Some(p) = m.prefill() {
            self.rope_cache(dev, m, &layer, 0..p.tokens, false)?;
        }
        let decode = match m.decode() {
            Some(d) => Some((d, self.rope_cache(dev, m, &layer, d.rows(), true)?)),
            None => None,
        };
        if let Some(p) = m.prefill() {
            self.prefill_attention(dev, p, &layer)?;
        }
        if let Some((d, absorbed)) = decode {
            self.decode_attention(dev, d, &layer, absorbed, decode_splits)?;
        }
        self.linears.linear(dev, &lw.o_proj.proj(), rows(&ws.attn_out, heads * V_HEAD), t, rows(&ws.delta, hidden))?;
        Ok(())
    }

    /// kv_a_layernorm, RoPE and the cache write for step rows `rows`. Decode rows (`decode`) also
    /// copy their roped q_pe into `q_abs` (whose row 0 is the first decode row), and a few of
    /// them are absorbed in the same launch (latent_cache.cu); returns whether they were.
    fn rope_cache(
        &self,
        dev: &Device,
        m: &StepMeta,
        layer: &LayerAttention,
        rows: Range<usize>,
        decode: bool,
    ) -> anyhow::Result<bool> {
        let ws = &self.ws;
        let heads = self.cfg.num_attention_heads;
        let (qd, lat) = (NOPE + ROPE, LATENT + ROPE);
        let absorb = decode && rows.len() <= SMALL_DECODE_TOKENS;
        let rope = RopeCache {
            tokens: rows.len(),
            heads,
            nope: NOPE,
            kv_lora_rank: LATENT,
            rope_dim: ROPE,
            kva: ws.kva.slice().tail(rows.start * lat),
            kva_stride: lat,
            kv_norm_w: layer.kv_a_norm,
            q: ws.q.slice().tail(rows.start * heads * qd),
            q_stride: heads * qd,
            q_pe_out: decode.then(|| (ws.q_abs.slice().tail(LATENT), heads * lat, lat)),
            positions: m.positions.sub(rows.start, rows.len()).on(layer.words),
            slots: m.slots.sub(rows.start, rows.len()).on(layer.words),
            inv_freq: self.inv_freq.slice(),
            attn_factor: self.attn_factor,
            eps: self.eps,
            cache: layer.cache,
            absorb: absorb.then(|| AbsorbQ {
                kv_b: layer.kv_b.w,
                v_dim: V_HEAD,
                q_abs: ws.q_abs.slice(),
                row_stride: heads * lat,
                head_stride: lat,
            }),
        };
        dev.k.latent.rope_cache(dev.stream(), &rope)?;
        Ok(absorb)
    }

    /// The absorbed path for the decode rows: W_UK (unless `rope_cache` did it), attention over
    /// the latent cache in latent space, then W_UV into the rows' attention output.
    fn decode_attention(
        &self,
        dev: &Device,
        d: &DecodeLayout,
        layer: &LayerAttention,
        absorbed: bool,
        decode_splits: usize,
    ) -> anyhow::Result<()> {
        let (s, k, ws) = (dev.stream(), &dev.k, &self.ws);
        let (cache, kv_b, words) = (layer.cache, &layer.kv_b, layer.words);
        let heads = self.cfg.num_attention_heads;
        let b = d.batch;
        if !absorbed {
            let q = ws.q.slice().tail(d.row0 * heads * (NOPE + ROPE));
            dev.blas.absorb_q(kv_b, heads, q, b, ws.q_abs.slice())?;
        }
        let attn_out = ws.attn_out.slice().tail(d.row0 * heads * V_HEAD);
        let p = DecodeAttention {
            batch: b,
            heads,
            q: ws.q_abs.slice(),
            cache,
            block_tables: d.block_tables.on(words),
            bt_stride: d.bt_stride.on(words),
            seq_lens: d.seq_lens.on(words),
            num_splits: decode_splits,
            out: ws.o_lat.slice(),
            part_o: ws.part_o.slice(),
            part_lse: ws.part_lse.slice(),
            scale: self.scale,
        };
        if b <= COMBINE_ABSORB_MAX_BATCH {
            // Small steps: the split merge and W_UV in one launch after the partials.
            k.attention.decode_partials(s, &p)?;
            k.attention.decode_combine_absorb_o(s, &p.partials(), kv_b, attn_out)
        } else {
            k.attention.decode(s, &p)?;
            dev.blas.absorb_o(kv_b, heads, ws.o_lat.slice(), b, attn_out)
        }
    }

    /// The normal path: per pass over a window of cached keys, decompress them through kv_b and
    /// run causal flash attention, carrying the running state between passes.
    fn prefill_attention(&self, dev: &Device, p: &PrefillLayout, layer: &LayerAttention) -> anyhow::Result<()> {
        let (s, k, ws) = (dev.stream(), &dev.k, &self.ws);
        let (cache, kv_b, words) = (layer.cache, &layer.kv_b, layer.words);
        let heads = self.cfg.num_attention_heads;
        let (qd, lat, kvw) = (NOPE + ROPE, LATENT + ROPE, heads * (NOPE + V_HEAD));
        for pass in &p.passes {
            // The window's cached rows as bf16: a copy, or the exact dequantization of FP8 rows.
            if cache.is_fp8() {
                k.latent.gather_fp8(s, cache, pass.slots.on(words), ws.latent.slice(), pass.keys)?;
            } else {
                // SAFETY: a bf16 cache's bytes are bf16 values.
                let rows = unsafe { cache.bytes.reinterpret::<bf16>(cache.bytes.len / 2) };
                k.elementwise.gather_rows(s, rows, pass.slots.on(words), ws.latent.slice(), pass.keys, lat)?;
            }
            dev.blas.linear(kv_b, rows(&ws.latent, lat), pass.keys, rows(&ws.kv, kvw))?;
            let a = PrefillAttention {
                heads,
                q_rows: p.tokens,
                q: ws.q.slice(),
                q_stride: heads * qd,
                k_rows: pass.keys,
                kv: ws.kv.slice(),
                kv_stride: kvw,
                kpe: ws.latent.slice().tail(LATENT),
                kpe_stride: lat,
                out: ws.attn_out.slice(),
                out_stride: heads * V_HEAD,
                state_o: ws.state_o.slice(),
                state_ml: ws.state_ml.slice(),
                tiles: p.tile_seq.len,
                tile_seq: p.tile_seq.on(words),
                tile_q0: p.tile_q0.on(words),
                seqs: p.seqs,
                cu_q: p.cu_q.on(words),
                q_pos0: p.q_pos0.on(words),
                k_row0: pass.k_row0.on(words),
                k_pos0: pass.k_pos0.on(words),
                k_len: pass.k_len.on(words),
                scale: self.scale,
                pass: PrefillPass { load_state: pass.load_state, last: pass.last },
            };
            k.attention.prefill(s, &a)?;
        }
        Ok(())
    }
}
