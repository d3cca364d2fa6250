//! DeepSeek rotary embedding: consecutive pairs `(x[2i], x[2i+1])` rotate by `pos * inv_freq[i]`
//! (GPT-J / interleaved layout), with YaRN-corrected frequencies and cos/sin scaled by the YaRN
//! attention factor, as HF does.
//!
//! Layout note: HF's V2 code keeps the rotated pairs interleaved, its V3 code writes all first
//! components then all second components. Both rotate q_pe and k_pe identically, so their dot
//! products (the only thing attention uses) are equal; we keep the interleaved layout everywhere,
//! including in the KV cache.

use mla_core::ModelConfig;

#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// One frequency per rotated pair (`qk_rope_head_dim / 2`).
    pub inv_freq: Vec<f32>,
    /// HF's `attention_scaling`, multiplied into cos and sin.
    pub attention_factor: f32,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Self {
        Rope { inv_freq: cfg.rope_inv_freq(), attention_factor: cfg.rope_attention_factor() as f32 }
    }

    /// Rotates `x` (length `2 * inv_freq.len()`) in place for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        apply_rope(x, pos, &self.inv_freq, self.attention_factor);
    }
}

/// Rotates consecutive pairs of `x` for position `pos`. Reference for GPU kernels.
///
/// The angle is formed in f32 as HF does (`inv_freq @ position_ids` in float32), so positions
/// far from zero round the same way.
pub fn apply_rope(x: &mut [f32], pos: usize, inv_freq: &[f32], attention_factor: f32) {
    assert_eq!(x.len(), 2 * inv_freq.len(), "rope: vector length must be twice the frequencies");
    for (pair, &f) in x.chunks_exact_mut(2).zip(inv_freq) {
        let angle = pos as f32 * f;
        let (cos, sin) = (angle.cos() * attention_factor, angle.sin() * attention_factor);
        let (a, b) = (pair[0], pair[1]);
        pair[0] = a * cos - b * sin;
        pair[1] = b * cos + a * sin;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_pairs_by_hand_computed_angles() {
        // Pair 0 at frequency 1 and pos 2 turns by 2 rad; pair 1 at frequency 0.5 by 1 rad.
        let mut x = [1.0, 0.0, 0.0, 2.0];
        apply_rope(&mut x, 2, &[1.0, 0.5], 1.0);
        let e = [2f32.cos(), 2f32.sin(), -2.0 * 1f32.sin(), 2.0 * 1f32.cos()];
        for (a, b) in x.iter().zip(e) {
            assert!((a - b).abs() < 1e-6, "{x:?} vs {e:?}");
        }
        let mut y = [1.0, 0.0];
        apply_rope(&mut y, 0, &[1.0], 1.5);
        assert_eq!(y, [1.5, 0.0]);
    }
}
