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
