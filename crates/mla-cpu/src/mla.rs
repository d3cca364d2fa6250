//! One MLA attention layer over a step's tokens: projections, latent normalisation, RoPE, cache
//! writes, then each sequence's path (normal or absorbed), then `o_proj`.

use crate::attention_absorbed::absorbed_attention;
use crate::attention_normal::normal_attention;
use crate::kv_cache::LatentCache;
use crate::mla_dims::MlaDims;
use crate::model_weights::{MlaWeights, QueryWeights};
use crate::norm::{rms_norm, rms_norm_rows};
use crate::rope::Rope;
use mla_core::step::plan::slot_of;

/// HF builds `q_a_layernorm` and `kv_a_layernorm` with RMSNorm's default epsilon, not
/// `config.rms_norm_eps` (which only the decoder-layer and final norms use).
pub const LATENT_NORM_EPS: f32 = 1e-6;

/// Which attention formulation a sequence's tokens use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionPath {
    /// Decompressed MHA (prefill).
    Normal,
    /// MQA in latent space (decode).
    Absorbed,
}

/// One sequence's tokens inside the flattened step batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqSpan<'a> {
    /// Index of the sequence's first token in the batch.
    pub start: usize,
    pub len: usize,
    /// Position of the first fed token (tokens before it are already cached).
    pub context_len: usize,
    pub block_table: &'a [u32],
    /// Prompt chunks take the normal path, decode rows the absorbed one, in the same step.
    pub path: AttentionPath,
}

/// Everything attention needs that does not change between layers.
pub struct MlaContext<'a> {
    pub dims: MlaDims,
    pub rope: &'a Rope,
    pub softmax_scale: f32,
    pub block_size: usize,
}

/// `x [n_tokens, hidden]` (already input-normed) -> attention output `[n_tokens, hidden]`.
/// Writes every fed token's `[c_kv ; k_pe]` into `cache` layer `layer` first, so a prefill
/// chunk attends to its own tokens (causally) as well as to the cached prefix.
pub fn mla_forward(
    w: &MlaWeights,
    ctx: &MlaContext,
    layer: usize,
    x: &[f32],
    seqs: &[SeqSpan],
    cache: &mut LatentCache,
) -> Vec<f32> {
    let d = ctx.dims;
    let mut q = match &w.query {
        QueryWeights::Direct { q_proj } => q_proj.forward(x),
        QueryWeights::LowRank { q_a_proj, q_a_layernorm, q_b_proj } => {
            q_b_proj.forward(&rms_norm_rows(&q_a_proj.forward(x), q_a_layernorm, LATENT_NORM_EPS))
        }
    };
    let kv = w.kv_a_proj_with_mqa.forward(x);
    let (qhd, ld, rank) = (d.q_head_dim(), d.latent_dim(), d.kv_lora_rank);

    for s in seqs {
        for j in 0..s.len {
            let (t, pos) = (s.start + j, s.context_len + j);
            for head in q[t * d.num_heads * qhd..(t + 1) * d.num_heads * qhd].chunks_mut(qhd) {
                ctx.rope.apply(&mut head[d.qk_nope_head_dim..], pos);
            }
            let raw = &kv[t * ld..(t + 1) * ld];
            let mut latent = rms_norm(&raw[..rank], &w.kv_a_layernorm, LATENT_NORM_EPS);
            let mut k_pe = raw[rank..].to_vec();
            ctx.rope.apply(&mut k_pe, pos);
            latent.extend_from_slice(&k_pe);
            cache.write(layer, slot_of(s.block_table, ctx.block_size, pos), &latent);
        }
    }

    let width = d.num_heads * d.v_head_dim;
    let n_tokens = x.len() / w.o_proj.rows;
    let mut attn_out = vec![0.0; n_tokens * width];
    for s in seqs {
        let latent = cache.gather(layer, s.block_table, s.context_len + s.len);
        let q_seq = &q[s.start * d.num_heads * qhd..(s.start + s.len) * d.num_heads * qhd];
        let q_pos: Vec<usize> = (s.context_len..s.context_len + s.len).collect();
        let out = match s.path {
            AttentionPath::Normal => normal_attention(&d, q_seq, &q_pos, &latent, &w.kv_b_proj, ctx.softmax_scale),
            AttentionPath::Absorbed => absorbed_attention(&d, q_seq, &q_pos, &latent, &w.kv_b_proj, ctx.softmax_scale),
        };
        attn_out[s.start * width..(s.start + s.len) * width].copy_from_slice(&out);
    }
    w.o_proj.forward(&attn_out)
}
