//! The paged latent KV cache: per layer, `num_blocks * block_size` slots of
//! `[c_kv (kv_lora_rank) ; k_pe (qk_rope_head_dim)]`. Both attention paths read this one cache.
//! It holds f32 values, or with `--kv-cache-dtype fp8` the FP8 rows of
//! `mla_core::model::latent_fp8` (the same bytes the CUDA backend stores), read back exactly.

use mla_core::model::latent_fp8;
use mla_core::step::plan::slot_of;
use mla_core::KvCacheDtype;

#[derive(Debug, Clone)]
enum Storage {
    /// `[layer][slot][dim]` values.
    F32(Vec<f32>),
    /// `[layer][slot][row_bytes(dim)]` FP8 rows.
    Fp8(Vec<u8>),
}

#[derive(Debug, Clone)]
pub struct LatentCache {
    num_layers: usize,
    block_size: usize,
    num_blocks: usize,
    /// Values per slot: `kv_lora_rank + qk_rope_head_dim`.
    dim: usize,
    storage: Storage,
}

impl LatentCache {
    pub fn new(num_layers: usize, block_size: usize, num_blocks: usize, dim: usize, dtype: KvCacheDtype) -> Self {
        let slots = num_layers * num_blocks * block_size;
        let storage = match dtype {
            KvCacheDtype::Auto => Storage::F32(vec![0.0; slots * dim]),
            KvCacheDtype::Fp8E4m3 => Storage::Fp8(vec![0; slots * latent_fp8::row_bytes(dim)]),
        };
        LatentCache { num_layers, block_size, num_blocks, dim, storage }
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

    /// What the cache stores.
    pub fn dtype(&self) -> KvCacheDtype {
        match self.storage {
            Storage::F32(_) => KvCacheDtype::Auto,
            Storage::Fp8(_) => KvCacheDtype::Fp8E4m3,
        }
    }

    /// The slot's index among all layers' slots.
    fn index(&self, layer: usize, slot: usize) -> usize {
        assert!(layer < self.num_layers && slot < self.num_blocks * self.block_size, "cache slot out of range");
        layer * self.num_blocks * self.block_size + slot
    }

    /// Stores one token's `[c_kv ; k_pe]` at physical `slot` (quantized in an FP8 cache).
    pub fn write(&mut self, layer: usize, slot: usize, latent: &[f32]) {
        assert_eq!(latent.len(), self.dim, "latent row width");
        let (i, dim) = (self.index(layer, slot), self.dim);
        match &mut self.storage {
            Storage::F32(data) => data[i * dim..(i + 1) * dim].copy_from_slice(latent),
            Storage::Fp8(data) => {
                let w = latent_fp8::row_bytes(dim);
                latent_fp8::quantize_row(latent, &mut data[i * w..(i + 1) * w]);
            }
        }
    }

    /// Copies block `from` into block `to` in every layer, byte for byte (`BlockFork`).
    pub fn copy_block(&mut self, from: usize, to: usize) {
        assert!(from < self.num_blocks && to < self.num_blocks, "cache block out of range");
        let row = match &self.storage {
            Storage::F32(_) => self.dim,
            Storage::Fp8(_) => latent_fp8::row_bytes(self.dim),
        };
        let len = self.block_size * row;
        for layer in 0..self.num_layers {
            let (src, dst) =
                (self.index(layer, from * self.block_size) * row, self.index(layer, to * self.block_size) * row);
            match &mut self.storage {
                Storage::F32(data) => data.copy_within(src..src + len, dst),
                Storage::Fp8(data) => data.copy_within(src..src + len, dst),
            }
        }
    }

    /// The values stored at `slot` (dequantized from an FP8 cache) into `out`.
    fn read_into(&self, layer: usize, slot: usize, out: &mut [f32]) {
        let (i, dim) = (self.index(layer, slot), self.dim);
        match &self.storage {
            Storage::F32(data) => out.copy_from_slice(&data[i * dim..(i + 1) * dim]),
            Storage::Fp8(data) => {
                let w = latent_fp8::row_bytes(dim);
                latent_fp8::dequantize_row(&data[i * w..(i + 1) * w], out);
            }
        }
    }

    /// Every stored FP8 row, writable: tests plant faults in the format through it (a scale off
    /// by a power of two must fail the accuracy bound). None in f32.
    pub fn fp8_rows_mut(&mut self) -> Option<&mut [u8]> {
        match &mut self.storage {
            Storage::F32(_) => None,
            Storage::Fp8(data) => Some(data),
        }
    }

    /// Logical positions `0..len` of one sequence as a contiguous `[len, dim]` copy, following
    /// its block table.
    pub fn gather(&self, layer: usize, block_table: &[u32], len: usize) -> Vec<f32> {
        let mut out = vec![0.0; len * self.dim];
        for (pos, dst) in out.chunks_mut(self.dim).enumerate() {
            self.read_into(layer, slot_of(block_table, self.block_size, pos), dst);
        }
        out
    }
}

/// Bytes of one token's row in one layer of a CPU cache of `dtype` (f32 values or FP8 rows).
pub fn bytes_per_row(dtype: KvCacheDtype, dim: usize) -> usize {
    match dtype {
        KvCacheDtype::Auto => dim * std::mem::size_of::<f32>(),
        KvCacheDtype::Fp8E4m3 => latent_fp8::row_bytes(dim),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copied_block_reads_back_as_its_source_in_every_layer_and_dtype() {
        for dtype in [KvCacheDtype::Auto, KvCacheDtype::Fp8E4m3] {
            let (layers, bs, dim) = (3, 4, 8);
            let mut c = LatentCache::new(layers, bs, 5, dim, dtype);
            for layer in 0..layers {
                for slot in 0..5 * bs {
                    let row: Vec<f32> = (0..dim).map(|d| (layer * 100 + slot * 10 + d) as f32 * 0.01).collect();
                    c.write(layer, slot, &row);
                }
            }
            let before: Vec<Vec<f32>> = (0..layers).map(|l| c.gather(l, &[1], bs)).collect();
            let neighbours: Vec<Vec<f32>> = (0..layers).map(|l| c.gather(l, &[2, 4], 2 * bs)).collect();
            c.copy_block(1, 3);
            for l in 0..layers {
                assert_eq!(c.gather(l, &[3], bs), before[l], "{dtype:?}, layer {l}");
                assert_eq!(c.gather(l, &[1], bs), before[l], "{dtype:?}, layer {l}: the source stays");
                assert_eq!(c.gather(l, &[2, 4], 2 * bs), neighbours[l], "{dtype:?}, layer {l}: nothing else moves");
            }
        }
    }
}
