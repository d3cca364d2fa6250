//! Decode attention (absorbed MQA over the paged latent cache, split-KV then combine) on the
//! V2-Lite shape at context 4096: both decode kernels at every batch from 1 to 256, over a bf16
//! cache and an FP8 cache (`--kv-cache-dtype fp8`), with time and effective bandwidth (the cache
//! bytes each reads); for batches small enough for the fused tail, also the whole attention tail
//! in its two forms (bf16 cache).

use super::timing::{fill, time_ms};
use super::{CONTEXT, HEADS};
use half::bf16;
use mla_core::KvCacheDtype;
use mla_cuda::gpu::DeviceBuffer;
use mla_cuda::ops::Normal;
use mla_cuda::ops::{
    cache_row_bytes, DecodeAttention, DecodeKernel, LatentCacheSlice, Linear, COMBINE_ABSORB_MAX_BATCH, LATENT, NOPE,
    PAGE_SIZE, ROPE, V_HEAD,
};
use mla_cuda::Device;
use serde_json::{json, Value};

const BATCHES: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The H100/H200 L2 is 50-60 MB: block-table sets over at least this many cache bytes are rotated
/// so that no launch finds the next one's pages already in L2.
const ROTATED_CACHE_BYTES: usize = 256 << 20;

/// One row per (kernel, batch), marking the kernel `DecodeKernel::for_cache` dispatches; for
/// batches up to `COMBINE_ABSORB_MAX_BATCH` two more rows: `decode_attention` (kernel + merge) then
/// cuBLAS `absorb_o`, against `decode_attention_partials` then `decode_combine_absorb_o`.
pub fn run(dev: &Device) -> anyhow::Result<Value> {
    let lat = LATENT + ROPE;
    let kvw = HEADS * (NOPE + V_HEAD);
    let kv_b_w = fill(dev, kvw * LATENT, 0.04, 3)?;
    let kv_b = Linear::new(kv_b_w.slice(), kvw, LATENT);
    let mut rows = vec![];
    for (batch, dtype) in BATCHES.into_iter().flat_map(|b| [(b, KvCacheDtype::Auto), (b, KvCacheDtype::Fp8E4m3)]) {
        let cache_name = if dtype.is_fp8() { "fp8" } else { "bf16" };
        let row = cache_row_bytes(dtype);
        let pages = CONTEXT / PAGE_SIZE;
        let set_bytes = batch * pages * PAGE_SIZE * row;
        let sets = ROTATED_CACHE_BYTES.div_ceil(set_bytes).max(2);
        let blocks = sets * batch * pages;
        let cache_buf = DeviceBuffer::<u8>::alloc(blocks * PAGE_SIZE * row)?;
        let cache = LatentCacheSlice { bytes: cache_buf.slice(), dtype };
        if dtype.is_fp8() {
            dev.k.latent.fill_fp8_random(dev.stream(), cache, 1)?;
        } else {
            // SAFETY: the buffer's bytes hold whole bf16 rows.
            let values = unsafe { cache_buf.slice().reinterpret(blocks * PAGE_SIZE * lat) };
            dev.k.elementwise.fill_normal_bf16(dev.stream(), values, Normal { mean: 0.0, std: 1.0, seed: 1 })?;
        }
        let tables = DeviceBuffer::from_host(&scattered_blocks(blocks))?;
        let stride = DeviceBuffer::from_host(&[pages as i32])?;
        let lens = DeviceBuffer::from_host(&vec![CONTEXT as i32; batch])?;
        let q = fill(dev, batch * HEADS * lat, 1.0, 2)?;
        let out = DeviceBuffer::<bf16>::alloc(batch * HEADS * LATENT)?;
        let attn_out = DeviceBuffer::<bf16>::alloc(batch * HEADS * V_HEAD)?;
        let splits = dev.k.attention.splits(batch, HEADS, pages);
        let part_o = DeviceBuffer::<f32>::alloc(batch * splits * HEADS * LATENT)?;
        let part_lse = DeviceBuffer::<f32>::alloc(batch * splits * HEADS)?;
        let params = |i: usize| DecodeAttention {
            batch,
            heads: HEADS,
            q: q.slice(),
            cache,
            block_tables: tables.tail((i % sets) * batch * pages),
            bt_stride: stride.slice(),
            seq_lens: lens.slice(),
            num_splits: splits,
            out: out.slice(),
            part_o: part_o.slice(),
            part_lse: part_lse.slice(),
            scale: 0.1147,
        };
        // The cache pages read, plus q in and the latent output out.
        let bytes = (batch * CONTEXT * row + batch * HEADS * (lat + LATENT) * 2) as f64;
        for which in DecodeKernel::ALL {
            let ms = time_ms(dev, 20, 15, |i| dev.k.attention.decode_with(dev.stream(), &params(i), which))?;
            let tbps = bytes / (ms * 1e-3) / 1e12;
            let chosen = which == DecodeKernel::for_cache(batch, dtype);
            println!(
                "decode attention {which:?} {cache_name} cache B={batch:<4} ctx {CONTEXT}: {:8.1} us  {tbps:.2} TB/s  ({splits} splits){}",
                ms * 1e3,
                if chosen { "  (dispatched)" } else { "" }
            );
            rows.push(json!({
                "kernel": format!("{which:?}"), "cache": cache_name, "dispatched": chosen, "batch": batch, "context": CONTEXT,
                "heads": HEADS, "splits": splits, "time_us": ms * 1e3, "bytes": bytes, "effective_TBps": tbps,
            }));
        }
        if batch <= COMBINE_ABSORB_MAX_BATCH && !dtype.is_fp8() {
            let two = time_ms(dev, 20, 15, |i| {
                dev.k.attention.decode(dev.stream(), &params(i))?;
                dev.blas.absorb_o(&kv_b, HEADS, out.slice(), batch, attn_out.slice())
            })?;
            let fused = time_ms(dev, 20, 15, |i| {
                let p = params(i);
                dev.k.attention.decode_partials(dev.stream(), &p)?;
                dev.k.attention.decode_combine_absorb_o(dev.stream(), &p.partials(), &kv_b, attn_out.slice())
            })?;
            println!(
                "decode attention + absorb_o B={batch}: two launches after the kernel {:6.1} us, fused combine+absorb_o {:6.1} us",
                two * 1e3,
                fused * 1e3
            );
            for (tail, ms) in
                [("decode_attention+absorb_o", two), ("decode_attention_partials+decode_combine_absorb_o", fused)]
            {
                rows.push(json!({
                    "tail": tail, "batch": batch, "context": CONTEXT, "heads": HEADS, "splits": splits,
                    "time_us": ms * 1e3,
                }));
            }
        }
    }
    Ok(json!(rows))
}

/// Block ids `0..blocks` in a fixed pseudo-random order: a block manager hands out scattered
/// pages, not one contiguous run.
fn scattered_blocks(blocks: usize) -> Vec<i32> {
    let mut tables: Vec<i32> = (0..blocks as i32).collect();
    for i in (1..tables.len()).rev() {
        let j = (i * 2_654_435_761) % (i + 1);
        tables.swap(i, j);
    }
    tables
}
