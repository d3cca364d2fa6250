//! `mla_rope_cache` against the CPU reference on the V2-Lite shape: q_pe rotated in place and
//! copied into the q_abs rows, the kv_a norm and RoPE written to the latent cache at scattered
//! slots, positions from 0 to the last of the context, and no write for a negative slot or to any
//! slot not asked for. (`gpu_rope_absorb` covers the same launch with the query absorption.)
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_latent -- --ignored`.

mod common;

use common::*;
use half::bf16;
use mla_cpu::{apply_rope, rms_norm};
use mla_cuda::gpu::DeviceBuffer;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rope_and_latent_cache_write_match_the_cpu_reference() {
    let dev = device();
    let (s, k) = (dev.stream(), &dev.k);
    let cfg = config("deepseek-v2-lite.json");
    let (heads, r, p) = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim);
    let (lat, qd) = (r + p, cfg.q_head_dim());
    let mut rng = Rng::new(2);
    let positions: Vec<i32> = vec![0, 1, 2, 63, 64, 4095, 4096, 100_000, 163_839];
    let t = positions.len();
    let n_slots = 4096;
    let mut slot_ids: Vec<i32> = (0..n_slots as i32).collect();
    rng.shuffle(&mut slot_ids);
    let mut slots = slot_ids[..t].to_vec();
    slots[3] = -1; // not written
    let kva = round(&rng.uniform(t * lat, 2.0));
    let q = round(&rng.uniform(t * heads * qd, 1.0));
    let w = round(&rng.uniform(r, 1.0));
    let sentinel = bf16::from_f32(-7.5);
    let cache = DeviceBuffer::from_host(&vec![sentinel; n_slots * lat]).unwrap();
    let (d_kva, d_q, d_w, d_pos, d_slots) = (up_bf16(&kva), up_bf16(&q), up_bf16(&w), up(&positions), up(&slots));
    let q_abs = DeviceBuffer::<bf16>::alloc(t * heads * lat).unwrap();
    let inv_freq = cfg.rope_inv_freq();
    let d_inv = up(&inv_freq);
    let (factor, eps) = (cfg.rope_attention_factor() as f32, cfg.rms_norm_eps as f32);
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
        cache: cache.slice().into(),
    };
    k.latent.rope_cache(s, &rope.params(None)).unwrap();
    dev.gpu.sync().unwrap();
    let cache_h = down_bf16(cache.slice());
    let q_h = down_bf16(d_q.slice());
    let q_abs_h = down_bf16(q_abs.slice());
    let (mut got, mut want) = (vec![], vec![]);
    for i in 0..t {
        let pos = positions[i] as usize;
        let mut qpe_want = vec![];
        for h in 0..heads {
            let base = (i * heads + h) * qd + cfg.qk_nope_head_dim;
            let mut x = q[base..base + p].to_vec();
            apply_rope(&mut x, pos, &inv_freq, factor);
            got.extend_from_slice(&q_h[base..base + p]);
            want.extend_from_slice(&x);
            let a = (i * heads + h) * lat + r;
            assert_eq!(&q_abs_h[a..a + p], &q_h[base..base + p], "q_pe copy, token {i} head {h}");
            qpe_want.push(x);
        }
        // Unrotated halves of q stay as they were.
        for h in 0..heads {
            let base = (i * heads + h) * qd;
            assert_eq!(&q_h[base..base + cfg.qk_nope_head_dim], &q[base..base + cfg.qk_nope_head_dim]);
        }
        if slots[i] < 0 {
            continue;
        }
        let row = &cache_h[slots[i] as usize * lat..(slots[i] as usize + 1) * lat];
        got.extend_from_slice(row);
        want.extend(rms_norm(&kva[i * lat..i * lat + r], &w, eps));
        let mut kpe = kva[i * lat + r..(i + 1) * lat].to_vec();
        apply_rope(&mut kpe, pos, &inv_freq, factor);
        want.extend(kpe);
    }
    let e = rel_l2(&got, &want);
    assert!(e < 6e-3, "rope/cache rel err {e}");
    let written: Vec<usize> = slots.iter().filter(|&&x| x >= 0).map(|&x| x as usize).collect();
    for sl in 0..n_slots {
        if !written.contains(&sl) {
            assert!(
                cache_h[sl * lat..(sl + 1) * lat].iter().all(|&x| x == -7.5),
                "slot {sl} written without being asked"
            );
        }
    }
}
