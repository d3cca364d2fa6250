//! `mla_rope_absorb_q` (rope/cache + query absorption in one launch, small decode steps) against
//! `mla_rope_cache` for everything they share (bit for bit) and an f64 host product for the
//! absorbed queries, on the V2-Lite shape with 1 to 4 tokens.
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_rope_absorb -- --ignored`.

mod common;

use common::*;
use half::bf16;
use mla_cuda::gpu::DeviceBuffer;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fused_rope_absorb_matches_rope_cache_and_an_f64_absorption() {
    let dev = device();
    let (s, k) = (dev.stream(), &dev.k);
    let cfg = config("deepseek-v2-lite.json");
    let (heads, r, p, nope, v) =
        (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim);
    let (lat, qd) = (r + p, cfg.q_head_dim());
    let mut rng = Rng::new(31);
    let kv_b = round(&rng.uniform(heads * (nope + v) * r, 0.1));
    let d_kv_b = up_bf16(&kv_b);
    let w = round(&rng.uniform(r, 1.0));
    let d_w = up_bf16(&w);
    let d_inv = up(&cfg.rope_inv_freq());
    for t in 1..=4usize {
        let positions: Vec<i32> = (0..t).map(|i| [5, 64, 4095, 100_000][i]).collect();
        let slots: Vec<i32> = (0..t).map(|i| [17, 3, 250, 128][i]).collect();
        let kva = round(&rng.uniform(t * lat, 2.0));
        let q = round(&rng.uniform(t * heads * qd, 1.0));
        // Each path on its own copies of q (rotated in place) and cache, outputs poisoned.
        let run = |absorb: bool| {
            let (d_kva, d_q, d_pos, d_slots) = (up_bf16(&kva), up_bf16(&q), up(&positions), up(&slots));
            let cache = DeviceBuffer::from_host(&vec![bf16::from_f32(-7.5); 256 * lat]).unwrap();
            let q_abs = DeviceBuffer::from_host(&vec![bf16::NAN; t * heads * lat]).unwrap();
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
            k.latent.rope_cache(s, &rope.params(absorb.then(|| d_kv_b.slice()))).unwrap();
            dev.gpu.sync().unwrap();
            (down_bf16(cache.slice()), down_bf16(d_q.slice()), down_bf16(q_abs.slice()))
        };
        let (cache_ref, q_ref, qabs_ref) = run(false);
        let (cache_got, q_got, qabs_got) = run(true);
        assert!(
            cache_got.iter().zip(&cache_ref).all(|(a, b)| a.to_bits() == b.to_bits()),
            "t={t}: cache rows differ from mla_rope_cache"
        );
        assert!(
            q_got.iter().zip(&q_ref).all(|(a, b)| a.to_bits() == b.to_bits()),
            "t={t}: roped q differs from mla_rope_cache"
        );
        let (mut got, mut want) = (vec![], vec![]);
        for i in 0..t {
            for h in 0..heads {
                let row = (i * heads + h) * lat;
                // The roped q_pe copy is mla_rope_cache's.
                for c in r..lat {
                    assert_eq!(qabs_got[row + c].to_bits(), qabs_ref[row + c].to_bits(), "t={t}: q_pe copy differs");
                }
                let qn = &q[(i * heads + h) * qd..(i * heads + h) * qd + nope];
                for c in 0..r {
                    let x: f64 = (0..nope).map(|d| qn[d] as f64 * kv_b[(h * (nope + v) + d) * r + c] as f64).sum();
                    want.push(x as f32);
                    got.push(qabs_got[row + c]);
                }
            }
        }
        assert!(got.iter().all(|x| x.is_finite()), "t={t}: absorbed queries not all written");
        let e = rel_l2(&got, &want);
        println!("rope+absorb t={t}: absorbed q rel err {e:.2e} against f64");
        // bf16 rounding of the output (2^-9 relative) dominates.
        assert!(e < 3e-3, "t={t}: absorbed q rel err {e}");
    }
}
