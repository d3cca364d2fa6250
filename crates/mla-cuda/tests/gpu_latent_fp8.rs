//! The FP8 latent cache on the device against mla-core's format functions, bit for bit:
//! - the cache write of `mla_rope_cache` (128 threads) and of `mla_rope_absorb_q`'s rope block
//!   (512 threads) into FP8 rows equals `latent_fp8::quantize_row` of the row the same launch
//!   writes into a bf16 cache, at scattered slots, with no other slot touched;
//! - `gather_latent_fp8` equals `latent_fp8::dequantize_row`.
//!
//! The kv_a_layernorm weight is planted so that the rows reach every case of the format: a group
//! whose values span seven decades (e4m3 subnormal codes), a group above 57,344 (the largest
//! scale: its largest values saturate), a group of zeros (exponent 127).
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_latent_fp8 -- --ignored`.

mod common;

use common::*;
use half::bf16;
use mla_core::model::latent_fp8;
use mla_core::KvCacheDtype;
use mla_cuda::gpu::DeviceBuffer;
use mla_cuda::ops::{LatentCacheSlice, LATENT_FP8_ROW_BYTES, LATENT_ROW};

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_cache_write_and_gather_equal_the_format_functions() {
    let dev = device();
    let (s, k) = (dev.stream(), &dev.k);
    let cfg = config("deepseek-v2-lite.json");
    let (heads, r, p) = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim);
    let (lat, qd) = (r + p, cfg.q_head_dim());
    assert_eq!((lat, latent_fp8::row_bytes(lat)), (LATENT_ROW, LATENT_FP8_ROW_BYTES));
    let mut rng = Rng::new(5);
    let positions: Vec<i32> = vec![0, 1, 63, 64, 4095, 100_000, 7, 9];
    let t = positions.len();
    let n_slots = 512;
    let mut slot_ids: Vec<i32> = (0..n_slots as i32).collect();
    rng.shuffle(&mut slot_ids);
    let mut slots = slot_ids[..t].to_vec();
    slots[2] = -1; // not written
    let kva = round(&rng.uniform(t * lat, 2.0));
    let q = round(&rng.uniform(t * heads * qd, 1.0));
    let mut w = round(&rng.uniform(r, 1.0));
    for (i, x) in w.iter_mut().enumerate() {
        match i / latent_fp8::GROUP {
            1 => *x = bf16::from_f32(10f32.powi(-((i % 8) as i32))).to_f32(), // seven decades
            3 => *x = bf16::from_f32(9.0e3 * (1.0 + (i % 5) as f32)).to_f32(), // amax past 57,344
            5 => *x = 0.0,                                                    // all zero
            _ => {}
        }
    }
    let kv_b = random_kv_b(&mut rng, heads);
    let (d_kva, d_w, d_pos, d_slots, d_inv, d_kvb) =
        (up_bf16(&kva), up_bf16(&w), up(&positions), up(&slots), up(&cfg.rope_inv_freq()), up_bf16(&kv_b));
    let sentinel = 0xa5u8;
    let mut failures = vec![];
    for absorb in [false, true] {
        // The same launch into a bf16 cache and into an FP8 cache.
        let bf16_cache = DeviceBuffer::from_host(&vec![bf16::from_f32(-7.5); n_slots * lat]).unwrap();
        let fp8_bytes = DeviceBuffer::from_host(&vec![sentinel; n_slots * LATENT_FP8_ROW_BYTES]).unwrap();
        for fp8 in [false, true] {
            let (d_q, q_abs) = (up_bf16(&q), DeviceBuffer::<bf16>::alloc(t * heads * lat).unwrap());
            let cache = if fp8 {
                LatentCacheSlice { bytes: fp8_bytes.slice(), dtype: KvCacheDtype::Fp8E4m3 }
            } else {
                bf16_cache.slice().into()
            };
            let rope = RopeCase {
                cfg: &cfg,
                tokens: t,
                kva: d_kva.slice(),
                kv_norm_w: d_w.slice(),
                q: d_q.slice(),
                q_abs: q_abs.slice(),
                positions: d_pos.slice(),
                slots: d_slots.slice(),
                inv_freq: d_inv.slice(),
                cache,
            };
            k.latent.rope_cache(s, &rope.params(absorb.then(|| d_kvb.slice()))).unwrap();
        }
        dev.gpu.sync().unwrap();
        let values = down_bf16(bf16_cache.slice());
        let bytes = down(fp8_bytes.slice());
        let rb = LATENT_FP8_ROW_BYTES;
        let mut written = vec![];
        for (i, &slot) in slots.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            let slot = slot as usize;
            written.push(slot);
            let mut want = vec![0u8; rb];
            latent_fp8::quantize_row(&values[slot * lat..(slot + 1) * lat], &mut want);
            let got = &bytes[slot * rb..(slot + 1) * rb];
            if got != want.as_slice() {
                let first = (0..rb).find(|&j| got[j] != want[j]).unwrap();
                failures.push(format!(
                    "absorb {absorb}, token {i}: byte {first} is {:#04x}, the format says {:#04x}",
                    got[first], want[first]
                ));
            }
            // The planted groups reach the cases they are there for.
            let e = |g: usize| want[lat + g];
            assert!(want[latent_fp8::GROUP..2 * latent_fp8::GROUP].iter().any(|&b| b & 0x7f != 0 && b & 0x78 == 0));
            assert_eq!(e(3), latent_fp8::MAX_EXPONENT, "group 3 does not reach the largest scale");
            assert!(want[3 * latent_fp8::GROUP..4 * latent_fp8::GROUP].iter().any(|&b| b & 0x7f == 0x7e));
            assert_eq!(e(5), 127);
        }
        for sl in (0..n_slots).filter(|sl| !written.contains(sl)) {
            if bytes[sl * rb..(sl + 1) * rb].iter().any(|&b| b != sentinel) {
                failures.push(format!("absorb {absorb}: slot {sl} written without being asked"));
            }
        }

        // The prefill gather of the written rows, against the format's dequantization.
        let idx: Vec<i32> = written.iter().map(|&x| x as i32).collect();
        let (d_idx, out) = (up(&idx), DeviceBuffer::<bf16>::alloc(idx.len() * lat).unwrap());
        let cache = LatentCacheSlice { bytes: fp8_bytes.slice(), dtype: KvCacheDtype::Fp8E4m3 };
        k.latent.gather_fp8(s, cache, d_idx.slice(), out.slice(), idx.len()).unwrap();
        dev.gpu.sync().unwrap();
        let got = down(out.slice());
        for (j, &slot) in written.iter().enumerate() {
            let mut want = vec![0f32; lat];
            latent_fp8::dequantize_row(&bytes[slot * rb..(slot + 1) * rb], &mut want);
            for c in 0..lat {
                let g = got[j * lat + c];
                if g.to_bits() != bf16::from_f32(want[c]).to_bits() || g.to_f32() != want[c] {
                    failures.push(format!("gather, slot {slot} column {c}: {g} against {}", want[c]));
                    break;
                }
            }
        }
    }
    assert!(failures.is_empty(), "FP8 cache:\n{}", failures.join("\n"));
}
