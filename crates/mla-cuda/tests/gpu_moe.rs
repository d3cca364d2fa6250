//! MoE routing (every `topk_method`) against mla-cpu's router, and the expert path (grouping,
//! gather, the grouped GEMMs of every tile height and schedule, combine) against host MLPs.
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_moe -- --ignored`.

mod common;

use common::*;
use half::bf16;
use mla_cpu::Matrix;
use mla_cuda::gpu::DeviceBuffer;
use mla_cuda::ops::*;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn moe_routing_matches_the_cpu_reference_for_every_method() {
    let dev = device();
    let (s, k) = (dev.stream(), &dev.k);
    // (config, seed, bias shift, (experts, n_group, topk_group, top_k) overrides, tied logits).
    // A shift below -1.25 makes every biased V3 score negative: experts of dropped groups must lose
    // to them (HF masks with -inf there, not 0.0). The kernel gives each group a run of 32 / n_group
    // lanes; the overridden layouts are ones no published model has (runs that leave spare lanes,
    // 15 experts a lane, a group per lane). Tied cases round the logits to 7 values (and V3's bias
    // to eighths), so ties break by index everywhere.
    type Shape = Option<(usize, usize, usize, usize)>;
    let cases: [(&str, u64, f32, Shape, bool); 10] = [
        ("deepseek-v2-lite.json", 10, 0.0, None, false),
        ("deepseek-v2.json", 11, 0.0, None, false),
        ("deepseek-v3.json", 12, 0.0, None, false),
        ("deepseek-v3.json", 13, -1.5, None, false),
        ("deepseek-v3.json", 14, 0.0, Some((72, 3, 2, 6)), false),
        ("deepseek-v3.json", 15, 0.0, Some((255, 17, 5, 8)), false),
        ("deepseek-v3.json", 16, 0.0, Some((64, 32, 6, 8)), false),
        ("deepseek-v3.json", 17, 0.0, None, true),
        ("deepseek-v2.json", 18, 0.0, Some((96, 6, 2, 6)), false),
        ("deepseek-v2.json", 19, 0.0, None, true),
    ];
    for (name, seed, shift, shape, tied) in cases {
        let mut cfg = config(name);
        if let Some((experts, groups, keep, top)) = shape {
            (cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) = (experts, groups, keep, top);
        }
        let name = format!("{name} {shape:?} tied {tied}");
        let mut rng = Rng::new(seed);
        let (t, e, top) = (300, cfg.n_routed_experts, cfg.num_experts_per_tok);
        let mut logits = rng.uniform(t * e, 3.0);
        if tied {
            logits.iter_mut().for_each(|x| *x = x.round());
        }
        let bias: Option<Vec<f32>> = (cfg.topk_method == mla_core::model::config::TopkMethod::NoauxTc).then(|| {
            rng.uniform(e, 0.25).iter().map(|b| if tied { (b * 8.0).round() / 8.0 } else { b + shift }).collect()
        });
        let bufs = RoutingBufs::new(t, e, top);
        let r = bufs.routing(t, e, top);
        let d_logits = up(&logits);
        let d_bias = bias.as_ref().map(|b| up(b));
        k.moe.route(s, d_logits.slice(), d_bias.as_ref().map(|b| b.slice()), &r, &RouteParams::of(&cfg)).unwrap();
        dev.gpu.sync().unwrap();
        let ids = down(bufs.ids.slice());
        let ws = down(bufs.w.slice());
        for tok in 0..t {
            let mut want = mla_cpu::route(&cfg, &logits[tok * e..(tok + 1) * e], bias.as_deref());
            want.sort_by_key(|x| x.0);
            let mut got: Vec<(usize, f32)> =
                (0..top).map(|j| (ids[tok * top + j] as usize, ws[tok * top + j])).collect();
            got.sort_by_key(|x| x.0);
            assert_eq!(
                got.iter().map(|x| x.0).collect::<Vec<_>>(),
                want.iter().map(|x| x.0).collect::<Vec<_>>(),
                "{name} token {tok}"
            );
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g.1 - w.1).abs() <= 1e-5 * w.1.abs().max(1.0),
                    "{name} token {tok}: weight {} vs {}",
                    g.1,
                    w.1
                );
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn moe_grouping_grouped_gemm_and_combine_match_the_cpu_reference() {
    let dev = device();
    // Sizes that are not tile multiples on purpose (K = 200 and 72 end in partial 64-wide
    // slices, N = 72 and 200 in partial column blocks), then the routed-expert intermediate a
    // rank has under tensor parallelism: V2-Lite at TP 8/4/2 (176, 352, 704; 176 ends in a
    // partial block), V2 and V3 at TP 8 (192, 256).
    for (i, inter) in [72usize, 176, 352, 704, 192, 256].into_iter().enumerate() {
        grouped_moe_case(&dev, 200, inter, 13 + i as u64);
    }
}

fn grouped_moe_case(dev: &mla_cuda::Device, hidden: usize, inter: usize, seed: u64) {
    let (s, k) = (dev.stream(), &dev.k);
    let mut rng = Rng::new(seed);
    // Uneven loads: 300 tokens over 16 experts, top-3, skewed so experts 0-3 get > 128 rows
    // (several tiles of every height), some few, expert 13 none.
    let (t, e, top) = (300usize, 16usize, 3usize);
    let mut ids = Vec::with_capacity(t * top);
    for _ in 0..t {
        let mut chosen: Vec<i32> = vec![];
        while chosen.len() < top {
            let x = if rng.below(3) == 0 { rng.below(e) } else { rng.below(4) } as i32;
            if x != 13 && !chosen.contains(&x) {
                chosen.push(x);
            }
        }
        ids.extend(chosen);
    }
    let wts: Vec<f32> = rng.uniform(t * top, 1.0).iter().map(|x| x.abs() + 0.1).collect();
    let x = round(&rng.uniform(t * hidden, 1.0));
    let gate_up = round(&rng.uniform(e * 2 * inter * hidden, 0.12));
    let down_w = round(&rng.uniform(e * hidden * inter, 0.2));
    let shared = round(&rng.uniform(t * hidden, 0.5));
    let bufs = RoutingBufs::new(t, e, top);
    bufs.ids.upload(&ids).unwrap();
    bufs.w.upload(&wts).unwrap();
    // Expert outputs.
    let mlp = |ex: usize, xt: &[f32]| -> Vec<f32> {
        let gu =
            Matrix::new(2 * inter, hidden, gate_up[ex * 2 * inter * hidden..(ex + 1) * 2 * inter * hidden].to_vec())
                .forward(xt);
        let act: Vec<f32> = (0..inter).map(|j| gu[j] / (1.0 + (-gu[j]).exp()) * gu[inter + j]).collect();
        Matrix::new(hidden, inter, down_w[ex * hidden * inter..(ex + 1) * hidden * inter].to_vec()).forward(&act)
    };
    let mut want = vec![0f32; t * hidden];
    for tok in 0..t {
        let xt = &x[tok * hidden..(tok + 1) * hidden];
        for j in 0..top {
            let y = mlp(ids[tok * top + j] as usize, xt);
            for (o, v) in want[tok * hidden..(tok + 1) * hidden].iter_mut().zip(y) {
                *o += wts[tok * top + j] * v;
            }
        }
        for (o, sh) in want[tok * hidden..(tok + 1) * hidden].iter_mut().zip(&shared[tok * hidden..(tok + 1) * hidden])
        {
            *o += sh;
        }
    }
    // Every GEMM variant this GPU has: mma.sync 64- and 16-row tiles, and on sm_90 the wgmma
    // kernels (128-row tiles, SiLU·mul fused into the gate/up GEMM) with every schedule.
    let any = Sm90Schedule::ALL[0];
    let mut variants = vec![(TileM::Rows64, any), (TileM::Rows16, any)];
    if k.grouped_gemm.available().contains(&TileM::Rows128) {
        variants.extend(Sm90Schedule::ALL.map(|sc| (TileM::Rows128, sc)));
    }
    for (tile, sched) in variants {
        let tile_m = tile.rows();
        let r = bufs.routing_tiles(t, e, top, tile);
        let (d_x, d_gu, d_down, d_shared) = (up_bf16(&x), up_bf16(&gate_up), up_bf16(&down_w), up_bf16(&shared));
        let a = t * top;
        // Poisoned outputs: every element the kernels own must be rewritten.
        let nan = |n: usize| DeviceBuffer::from_host(&vec![bf16::NAN; n]).unwrap();
        let gx = nan(a * hidden);
        let ggu = nan(a * 2 * inter);
        let gact = nan(a * inter);
        let gy = nan(a * hidden);
        let out = nan(t * hidden);
        k.moe.align(s, &r).unwrap();
        k.elementwise.gather_rows(s, d_x.slice(), r.perm_src, gx.slice(), r.rows(), hidden).unwrap();
        let gate_up = GroupedGateUp {
            a: gx.slice().into(),
            w: ExpertMats::Bf16(d_gu.slice()),
            gate_up: ggu.slice(),
            act: gact.slice(),
            inter,
            k: hidden,
        };
        k.grouped_gemm.gate_up_act_with(s, &gate_up, &r, sched).unwrap();
        let down_proj = GroupedGemm {
            a: gact.slice().into(),
            w: ExpertMats::Bf16(d_down.slice()),
            c: gy.slice(),
            n: hidden,
            k: inter,
        };
        k.grouped_gemm.gemm_with(s, &down_proj, &r, sched).unwrap();
        k.moe.combine(s, gy.slice(), &r, Some(d_shared.slice()), out.slice(), hidden).unwrap();
        dev.gpu.sync().unwrap();
        // The grouping itself: offsets are a prefix sum of the counts, every row used once.
        let off = down(bufs.off.slice());
        let mut counts = vec![0i32; e];
        ids.iter().for_each(|&i| counts[i as usize] += 1);
        for ex in 0..e {
            assert_eq!(off[ex + 1] - off[ex], counts[ex], "expert {ex} row count");
        }
        let mut inv = down(bufs.inv.slice());
        inv.sort();
        assert_eq!(inv, (0..a as i32).collect::<Vec<_>>());
        // Several tiles per expert at this height, and an empty expert.
        assert!(
            counts[..4].iter().all(|&c| c as usize > tile_m) && counts[13] == 0,
            "routing does not exercise the tile map: {counts:?}"
        );
        let got = down_bf16(out.slice());
        assert!(
            got.iter().all(|v| v.is_finite()),
            "MoE output has non-finite values at inter {inter} with tiles of {tile_m}"
        );
        let err = rel_l2(&got, &want);
        println!("MoE experts, inter {inter} (tiles of {tile_m} rows, {sched:?}) rel err {err:.2e}");
        assert!(err < 1.5e-2, "MoE rel err {err} at inter {inter} with tiles of {tile_m}, {sched:?}");
    }
}
