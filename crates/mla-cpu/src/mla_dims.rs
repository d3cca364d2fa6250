//! Shapes of one MLA layer and where each head's `W_UK` / `W_UV` live inside `kv_b_proj`.

use crate::linear::Matrix;
use mla_core::ModelConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaDims {
    pub num_heads: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub kv_lora_rank: usize,
}

impl MlaDims {
    pub fn from_config(cfg: &ModelConfig) -> Self {
        MlaDims {
            num_heads: cfg.num_attention_heads,
            qk_nope_head_dim: cfg.qk_nope_head_dim,
            qk_rope_head_dim: cfg.qk_rope_head_dim,
            v_head_dim: cfg.v_head_dim,
            kv_lora_rank: cfg.kv_lora_rank,
        }
    }

    /// Query / key width per head: nope + rope.
    pub fn q_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Width of one latent cache row: `[c_kv ; k_pe]`.
    pub fn latent_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Row `d` of head `h`'s `W_UK [qk_nope_head_dim, kv_lora_rank]` inside `kv_b_proj`, whose
    /// rows are grouped per head as `qk_nope_head_dim` key rows then `v_head_dim` value rows.
    pub fn w_uk_row<'a>(&self, kv_b: &'a Matrix, h: usize, d: usize) -> &'a [f32] {
        kv_b.row(h * (self.qk_nope_head_dim + self.v_head_dim) + d)
    }

    /// Row `d` of head `h`'s `W_UV [v_head_dim, kv_lora_rank]` inside `kv_b_proj`.
    pub fn w_uv_row<'a>(&self, kv_b: &'a Matrix, h: usize, d: usize) -> &'a [f32] {
        kv_b.row(h * (self.qk_nope_head_dim + self.v_head_dim) + self.qk_nope_head_dim + d)
    }

    /// Checks the argument sizes every attention reference function shares.
    pub(crate) fn check(&self, q: &[f32], q_pos: &[usize], latent: &[f32], kv_b: &Matrix) -> usize {
        assert_eq!(
            q.len(),
            q_pos.len() * self.num_heads * self.q_head_dim(),
            "queries must be [n_q, heads, q_head_dim]"
        );
        assert_eq!(latent.len() % self.latent_dim(), 0, "latent must be [n_kv, kv_lora_rank + qk_rope_head_dim]");
        assert_eq!(
            (kv_b.rows, kv_b.cols),
            (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
            "kv_b_proj shape"
        );
        let n_kv = latent.len() / self.latent_dim();
        assert!(q_pos.iter().all(|&p| p < n_kv), "a query position lies beyond the latent rows");
        n_kv
    }
}
