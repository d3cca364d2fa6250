//! The paged latent KV cache: per layer, `num_blocks * block_size` slots of
//! `[c_kv (kv_lora_rank) ; k_pe (qk_rope_head_dim)]`. Both attention paths read this one cache.

use mla_core::step::plan::slot_of;

#[derive(Debug, Clone)]
pub struct LatentCache {
    num_layers: usize,
    block_size: usize,
    num_blocks: usize,
    /// Values per slot: `kv_lora_rank + qk_rope_head_dim`.
    dim: usize,
    /// `[layer][slot][dim]`.
    data: Vec<f32>,
}

impl LatentCache {
    pub fn new(num_layers: usize, block_size: usize, num_blocks: usize, dim: usize) -> Self {
        let len = num_layers * num_blocks * block_size * dim;
        LatentCache { num_layers, block_size, num_blocks, dim, data: vec![0.0; len] }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    fn offset(&self, layer: usize, slot: usize) -> usize {
        assert!(layer < self.num_layers && slot < self.num_blocks * self.block_size, "cache slot out of range");
        (layer * self.num_blocks * self.block_size + slot) * self.dim
    }

    /// Stores one token's `[c_kv ; k_pe]` at physical `slot`.
    pub fn write(&mut self, layer: usize, slot: usize, latent: &[f32]) {
        assert_eq!(latent.len(), self.dim, "latent row width");
        let o = self.offset(layer, slot);
        self.data[o..o + self.dim].copy_from_slice(latent);
    }

    pub fn row(&self, layer: usize, slot: usize) -> &[f32] {
        let o = self.offset(layer, slot);
        &self.data[o..o + self.dim]
    }

    /// Logical positions `0..len` of one sequence as a contiguous `[len, dim]` copy, following
    /// its block table.
    pub fn gather(&self, layer: usize, block_table: &[u32], len: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(len * self.dim);
        for pos in 0..len {
            out.extend_from_slice(self.row(layer, slot_of(block_table, self.block_size, pos)));
        }
        out
    }
}
