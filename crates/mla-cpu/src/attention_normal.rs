//! The normal (decompressed) MLA path used for prefill: expand every cached latent row into
//! per-head keys `[W_UK c_kv ; k_pe]` and values `W_UV c_kv`, then causal multi-head attention
//! with query/key width `qk_nope + qk_rope` and value width `v_head_dim`.

use crate::linear::Matrix;
use crate::mla_dims::MlaDims;
use crate::softmax::softmax_in_place;
use rayon::prelude::*;

/// Expands latent rows `[n, kv_lora_rank + qk_rope]` into keys `[n, heads, q_head_dim]` and values
/// `[n, heads, v_head_dim]`. Reference for GPU kernels.
pub fn decompress_latent(d: &MlaDims, latent: &[f32], kv_b: &Matrix) -> (Vec<f32>, Vec<f32>) {
    let n = latent.len() / d.latent_dim();
    let c_kv: Vec<f32> = latent.chunks(d.latent_dim()).flat_map(|r| &r[..d.kv_lora_rank]).copied().collect();
    let kv = kv_b.forward(&c_kv); // [n, heads * (nope + v)]
    let per_head = d.qk_nope_head_dim + d.v_head_dim;
    let mut keys = Vec::with_capacity(n * d.num_heads * d.q_head_dim());
    let mut values = Vec::with_capacity(n * d.num_heads * d.v_head_dim);
    for t in 0..n {
        let k_pe = &latent[t * d.latent_dim() + d.kv_lora_rank..(t + 1) * d.latent_dim()];
        for h in 0..d.num_heads {
            let row = &kv[(t * d.num_heads + h) * per_head..][..per_head];
            keys.extend_from_slice(&row[..d.qk_nope_head_dim]);
            keys.extend_from_slice(k_pe);
            values.extend_from_slice(&row[d.qk_nope_head_dim..]);
        }
    }
    (keys, values)
}

/// Head count and per-head widths of a multi-head attention.
#[derive(Debug, Clone, Copy)]
pub struct HeadDims {
    pub heads: usize,
    pub qk_dim: usize,
    pub v_dim: usize,
}

/// Causal multi-head attention. `q [n_q, heads, qk_dim]`, `k [n_kv, heads, qk_dim]`,
/// `v [n_kv, heads, v_dim]`; query `i` attends to key rows `0..=q_pos[i]`. Returns
/// `[n_q, heads, v_dim]`. Reference for GPU kernels.
pub fn causal_attention(q: &[f32], k: &[f32], v: &[f32], q_pos: &[usize], dims: HeadDims, scale: f32) -> Vec<f32> {
    let HeadDims { heads, qk_dim, v_dim } = dims;
    let mut out = vec![0.0; q_pos.len() * heads * v_dim];
    out.par_chunks_mut(v_dim).enumerate().for_each(|(qh, o)| {
        let (i, h) = (qh / heads, qh % heads);
        let qv = &q[qh * qk_dim..][..qk_dim];
        let visible = q_pos[i] + 1;
        let mut scores: Vec<f32> =
            (0..visible).map(|t| crate::linear::dot(qv, &k[(t * heads + h) * qk_dim..][..qk_dim]) * scale).collect();
        softmax_in_place(&mut scores);
        for (t, p) in scores.iter().enumerate() {
            crate::linear::axpy(*p, &v[(t * heads + h) * v_dim..][..v_dim], o);
        }
    });
    out
}

/// Normal-path MLA over a sequence's latent rows. `q [n_q, heads, qk_nope + qk_rope]` with q_pe
/// already rotated; `latent [n_kv, kv_lora_rank + qk_rope]` (normed c_kv, rotated k_pe) as the
/// cache holds it; query `i` sees rows `0..=q_pos[i]`. Returns `[n_q, heads, v_head_dim]`.
pub fn normal_attention(
    d: &MlaDims,
    q: &[f32],
    q_pos: &[usize],
    latent: &[f32],
    kv_b: &Matrix,
    scale: f32,
) -> Vec<f32> {
    d.check(q, q_pos, latent, kv_b);
    let (keys, values) = decompress_latent(d, latent, kv_b);
    let dims = HeadDims { heads: d.num_heads, qk_dim: d.q_head_dim(), v_dim: d.v_head_dim };
    causal_attention(q, &keys, &values, q_pos, dims, scale)
}
