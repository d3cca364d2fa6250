//! The absorbed MLA path used for decode: fold `W_UK` into the query (`q_lat = W_UKᵀ q_nope`,
//! width `kv_lora_rank`), attend over the latent rows as MQA with one shared KV head
//! (`score = q_lat·c_kv + q_pe·k_pe`), then map the latent output back with `W_UV`.
//! Mathematically identical to the normal path; it never materialises per-head keys or values.

use crate::linear::{axpy, dot, Matrix};
use crate::mla_dims::MlaDims;
use crate::softmax::softmax_in_place;
use rayon::prelude::*;

/// Absorbed-path MLA over a cache slice. Same arguments and result as
/// [`crate::attention_normal::normal_attention`]: `q [n_q, heads, qk_nope + qk_rope]`,
/// `latent [n_kv, kv_lora_rank + qk_rope]`, query `i` sees rows `0..=q_pos[i]`; returns
/// `[n_q, heads, v_head_dim]`. Reference for GPU decode kernels.
pub fn absorbed_attention(
    d: &MlaDims,
    q: &[f32],
    q_pos: &[usize],
    latent: &[f32],
    kv_b: &Matrix,
    scale: f32,
) -> Vec<f32> {
    d.check(q, q_pos, latent, kv_b);
    let (nope, rank, ld) = (d.qk_nope_head_dim, d.kv_lora_rank, d.latent_dim());
    let mut out = vec![0.0; q_pos.len() * d.num_heads * d.v_head_dim];
    out.par_chunks_mut(d.v_head_dim).enumerate().for_each(|(qh, o)| {
        let (i, h) = (qh / d.num_heads, qh % d.num_heads);
        let qv = &q[qh * d.q_head_dim()..][..d.q_head_dim()];
        let (q_nope, q_pe) = qv.split_at(nope);
        let mut q_lat = vec![0.0; rank];
        for (j, &qn) in q_nope.iter().enumerate() {
            axpy(qn, d.w_uk_row(kv_b, h, j), &mut q_lat);
        }
        let visible = q_pos[i] + 1;
        let mut scores: Vec<f32> = (0..visible)
            .map(|t| {
                let row = &latent[t * ld..(t + 1) * ld];
                (dot(&q_lat, &row[..rank]) + dot(q_pe, &row[rank..])) * scale
            })
            .collect();
        softmax_in_place(&mut scores);
        let mut o_lat = vec![0.0; rank];
        for (t, p) in scores.iter().enumerate() {
            axpy(*p, &latent[t * ld..t * ld + rank], &mut o_lat);
        }
        for (j, y) in o.iter_mut().enumerate() {
            *y = dot(d.w_uv_row(kv_b, h, j), &o_lat);
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention_normal::normal_attention;
    use mla_core::SplitMix64;

    fn random(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
        (0..n).map(|_| (rng.next_f64() * 2.0 - 1.0) as f32).collect()
    }

    #[test]
    fn absorbed_equals_normal_on_the_same_latents() {
        let d = MlaDims { num_heads: 3, qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: 6, kv_lora_rank: 16 };
        let mut rng = SplitMix64::new(11);
        let n_kv = 9;
        let latent = random(&mut rng, n_kv * d.latent_dim());
        let kv_b = Matrix::new(d.num_heads * 14, 16, random(&mut rng, d.num_heads * 14 * 16));
        let q_pos = [0, 4, 8, 8];
        let q = random(&mut rng, q_pos.len() * d.num_heads * d.q_head_dim());
        let a = absorbed_attention(&d, &q, &q_pos, &latent, &kv_b, 0.3);
        let n = normal_attention(&d, &q, &q_pos, &latent, &kv_b, 0.3);
        let worst = a.iter().zip(&n).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
        assert!(worst < 1e-5, "max difference {worst}");
        // Position 0 sees one row: the output is exactly W_UV c_kv[0] for every head.
        for h in 0..d.num_heads {
            for j in 0..d.v_head_dim {
                let want = dot(d.w_uv_row(&kv_b, h, j), &latent[..d.kv_lora_rank]);
                assert!((a[h * d.v_head_dim + j] - want).abs() < 1e-5);
            }
        }
    }
}
