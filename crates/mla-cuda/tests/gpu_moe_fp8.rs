//! The MoE kernels on block-FP8 expert weights (`ExpertMats::Fp8`: e4m3 bytes, one f32 scale per
//! 128x128 block of each expert, scales over four decades, random bytes but the NaN codes):
//!
//! - the grouped GEMMs of every tile height (and on sm_90 every wgmma schedule) are bitwise equal
//!   to the bf16 kernels on the same weights dequantized on the host to bf16
//!   (`bf16(float(e4m3) · scale)`, the operands the FP8 kernels stage), with partial scale blocks
//!   in N and K, partial row tiles, uneven experts and an expert without rows; a wrong scale grid
//!   is shown to break equality;
//! - the small-step GEMV path (`MoeGemvKernels::experts`, routed and shared experts) against an
//!   f64 reference of the same math with its bf16 rounding points (tight), against the bf16
//!   kernels on host-dequantized weights (looser), and against a reference reading the scale grid
//!   wrongly (which must fail);
//! - the W8A8 wgmma kernels (e4m3 activations with per-row, per-128-column scales from the
//!   device quantizer) against an f64 product of the same quantized operands, rows and groups at
//!   magnitudes over two decades; references that read the activation or weight scales wrongly
//!   must fail;
//! - the wrappers' refusals: mixed formats, an FP8 gate/up whose width is not a multiple of 128,
//!   W8A8 without FP8 weights, 128-row tiles or 128-row items.
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_moe_fp8 -- --ignored`.

mod common;

use common::*;
use half::bf16;
use mla_cuda::gpu::{DSlice, DeviceBuffer};
use mla_cuda::ops::*;

fn nan_bf16(n: usize) -> DeviceBuffer<bf16> {
    DeviceBuffer::from_host(&vec![bf16::NAN; n]).unwrap()
}

fn bits(s: DSlice<bf16>) -> Vec<u16> {
    down(s).iter().map(|x| x.to_bits()).collect()
}

fn fp8_mats<'a>(w: &'a (DeviceBuffer<u8>, DeviceBuffer<f32>)) -> ExpertMats<'a> {
    ExpertMats::Fp8 { w: w.0.slice(), scale_inv: w.1.slice() }
}

/// `top` distinct experts per token, skewed so that expert 0 gets most tokens (several tiles of
/// every height, the last partial), the others few and `empty` none.
fn skewed_ids(rng: &mut Rng, t: usize, e: usize, top: usize, empty: usize) -> Vec<i32> {
    let mut ids = Vec::with_capacity(t * top);
    for _ in 0..t {
        let mut chosen: Vec<i32> = vec![];
        while chosen.len() < top {
            let x = if rng.below(2) == 0 { 0 } else { rng.below(e) } as i32;
            if x as usize != empty && !chosen.contains(&x) {
                chosen.push(x);
            }
        }
        ids.extend(chosen);
    }
    ids
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn grouped_fp8_gemms_are_bitwise_equal_to_bf16_on_host_dequantized_weights() {
    let dev = device();
    let (s, k) = (dev.stream(), &dev.k);
    let mut rng = Rng::new(71);
    let (t, e, top, empty) = (200usize, 6usize, 2usize, 3usize);
    let ids = skewed_ids(&mut rng, t, e, top, empty);
    let bufs = RoutingBufs::new(t, e, top);
    bufs.ids.upload(&ids).unwrap();
    let rows = t * top;
    let mut counts = vec![0usize; e];
    ids.iter().for_each(|&i| counts[i as usize] += 1);
    assert!(counts[0] > 128 && counts[empty] == 0, "routing does not exercise the tile map: {counts:?}");
    // Plain GEMM [N, K] = [200, 328]: 1.56 x 2.56 scale blocks, partial N and K tiles. Gate/up:
    // I = 256 (two blocks each for gate and up), K = 200; and I = 128 with K = 328.
    let gemm_shapes = [(200usize, 328usize), (328, 200)];
    let gate_up_shapes = [(256usize, 200usize), (128, 328)];
    let mut variants = vec![];
    for tile in k.grouped_gemm.available_fp8() {
        let schedules = if tile == TileM::Rows128 { Sm90Schedule::ALL.to_vec() } else { vec![Sm90Schedule::ALL[0]] };
        variants.extend(schedules.into_iter().map(|sc| (tile, sc)));
    }
    for (tile, sched) in variants {
        let r = bufs.routing_tiles(t, e, top, tile);
        k.moe.align(s, &r).unwrap();
        for &(n, kk) in &gemm_shapes {
            let w = Fp8Stack::random(&mut rng, e, n, kk);
            let a = up_bf16(&rng.uniform(rows * kk, 1.0));
            let (w8, w16) = (w.upload(), up_bf16(&w.dequant_f32()));
            let wrong = w.with_shifted_scales().upload();
            let run = |mats: ExpertMats| {
                let c = nan_bf16(rows * n);
                let p = GroupedGemm { a: a.slice().into(), w: mats, c: c.slice(), n, k: kk };
                k.grouped_gemm.gemm_with(s, &p, &r, sched).unwrap();
                dev.gpu.sync().unwrap();
                bits(c.slice())
            };
            let want = run(ExpertMats::Bf16(w16.slice()));
            assert!(want.iter().all(|&b| bf16::from_bits(b).is_finite()), "bf16 GEMM left rows unwritten");
            let got = run(fp8_mats(&w8));
            let diff = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            println!("{tile:?} {sched:?} GEMM [{n}, {kk}]: {diff} of {} outputs differ", got.len());
            assert_eq!(diff, 0, "{tile:?} {sched:?} GEMM [{n}, {kk}]: FP8 differs from bf16 on dequantized weights");
            let off = run(fp8_mats(&wrong)).iter().zip(&want).filter(|(a, b)| a != b).count();
            assert!(off > got.len() / 2, "{tile:?} {sched:?} GEMM [{n}, {kk}]: shifted scales unnoticed ({off})");
        }
        for &(inter, kk) in &gate_up_shapes {
            let w = Fp8Stack::random(&mut rng, e, 2 * inter, kk);
            let a = up_bf16(&rng.uniform(rows * kk, 1.0));
            let (w8, w16) = (w.upload(), up_bf16(&w.dequant_f32()));
            let run = |mats: ExpertMats| {
                let (gu, act) = (nan_bf16(rows * 2 * inter), nan_bf16(rows * inter));
                let p =
                    GroupedGateUp { a: a.slice().into(), w: mats, gate_up: gu.slice(), act: act.slice(), inter, k: kk };
                k.grouped_gemm.gate_up_act_with(s, &p, &r, sched).unwrap();
                dev.gpu.sync().unwrap();
                (bits(gu.slice()), bits(act.slice()))
            };
            let want = run(ExpertMats::Bf16(w16.slice()));
            assert!(want.1.iter().all(|&b| bf16::from_bits(b).is_finite()), "bf16 gate/up left rows unwritten");
            let got = run(fp8_mats(&w8));
            // The wgmma tiles fuse SiLU·mul and leave the [rows, 2I] scratch alone.
            let compared = if tile == TileM::Rows128 { (vec![], got.1) } else { got };
            let want = if tile == TileM::Rows128 { (vec![], want.1) } else { want };
            assert!(compared == want, "{tile:?} {sched:?} gate/up I={inter} K={kk}: FP8 differs from bf16");
            println!("{tile:?} {sched:?} gate/up I={inter} K={kk}: bitwise equal");
        }
    }
    // The tile for FP8 weights is one with FP8 kernels.
    for tokens in [1, 16, 4096] {
        let tile = k.grouped_gemm.tile_for_mats(tokens, top, e, true, false);
        assert!(k.grouped_gemm.available_fp8().contains(&tile), "tile_for_mats picked {tile:?} for FP8");
    }
    let w8 = Fp8Stack::random(&mut rng, e, 256, 256).upload();
    let (a, c) = (up_bf16(&vec![0.0; rows * 256]), nan_bf16(rows * 256));
    // A gate/up width that is not a multiple of 128 would misplace the up rows' scales.
    let r = bufs.routing_tiles(t, e, top, TileM::Rows64);
    let g =
        GroupedGateUp { a: a.slice().into(), w: fp8_mats(&w8), gate_up: c.slice(), act: c.slice(), inter: 64, k: 256 };
    let err = k.grouped_gemm.gate_up_act(s, &g, &r).unwrap_err().to_string();
    assert!(err.contains("multiple of 128"), "{err}");
}

/// Grouped activations `[rows, k]` with each row and 128-column group at its own magnitude,
/// 10^[-1, 1), quantized on the device; returns the device copy and its exact values in f64
/// (`e4m3 · scale`, read back from the device), and the same read with every row taking the next
/// row's scales (what a kernel indexing the scales wrongly would compute).
fn quantized_act<'a>(
    dev: &mla_cuda::Device,
    rng: &mut Rng,
    rows: usize,
    k: usize,
    q: &'a DeviceBuffer<u8>,
    scales: &'a DeviceBuffer<f32>,
) -> (Fp8Act<'a>, Vec<f64>, Vec<f64>) {
    let groups = k.div_ceil(FP8_BLOCK);
    let mag = rng.uniform(rows * groups, 1.0);
    let x: Vec<f32> = rng
        .uniform(rows * k, 1.0)
        .iter()
        .enumerate()
        .map(|(i, v)| v * 10f32.powf(mag[i / k * groups + i % k / FP8_BLOCK]))
        .collect();
    let xd = up_bf16(&x);
    let act = Fp8Act { q: q.slice(), scales: scales.slice(), scale_ld: rows };
    dev.k.fp8_convert.quantize_act(dev.stream(), Strided::new(xd.slice(), k), rows, k, &act).unwrap();
    dev.gpu.sync().unwrap();
    let (qh, sh) = (down(q.slice()), down(scales.slice()));
    let exact = |shift: usize| -> Vec<f64> {
        (0..rows * k)
            .map(|i| {
                let (r, c) = (i / k, i % k);
                let sc = sh[c / FP8_BLOCK * rows + (r + shift) % rows];
                mla_core::model::fp8::fp8_e4m3_to_f32(qh[i]) as f64 * sc as f64
            })
            .collect()
    };
    (act, exact(0), exact(1))
}

/// `c[i] = a[i] · w[expert of i]ᵀ` in f64 over grouped rows (`off`: the experts' row offsets).
fn grouped_f64(a: &[f64], w: &[f64], off: &[i32], n: usize, k: usize) -> Vec<f64> {
    let rows = a.len() / k;
    let mut c = vec![0.0; rows * n];
    for e in 0..off.len() - 1 {
        for i in off[e] as usize..off[e + 1] as usize {
            for j in 0..n {
                let wr = &w[(e * n + j) * k..(e * n + j + 1) * k];
                c[i * n + j] = a[i * k..(i + 1) * k].iter().zip(wr).map(|(x, y)| x * y).sum();
            }
        }
    }
    c
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn grouped_w8a8_gemms_match_f64_on_the_quantized_operands() {
    let dev = device();
    let (s, k) = (dev.stream(), &dev.k);
    if !k.grouped_gemm.has_w8a8() {
        println!("SKIPPED: the W8A8 grouped GEMM needs sm_90");
        return;
    }
    let mut rng = Rng::new(83);
    let (t, e, top, empty) = (200usize, 6usize, 2usize, 3usize);
    let ids = skewed_ids(&mut rng, t, e, top, empty);
    let bufs = RoutingBufs::new(t, e, top);
    bufs.ids.upload(&ids).unwrap();
    let rows = t * top;
    let r = bufs.routing_tiles(t, e, top, TileM::Rows128);
    k.moe.align(s, &r).unwrap();
    dev.gpu.sync().unwrap();
    let off = down(bufs.off.slice());
    let q = DeviceBuffer::<u8>::alloc(rows * 400).unwrap();
    let scales = DeviceBuffer::<f32>::alloc(rows * 4).unwrap();
    // Plain GEMM: N = 200 (1.56 scale blocks), K = 336 (2.625 groups); N = 328, K = 208.
    for (n, kk) in [(200usize, 336usize), (328, 208)] {
        let w = Fp8Stack::random(&mut rng, e, n, kk);
        let (act, a64, a64_shifted) = quantized_act(&dev, &mut rng, rows, kk, &q, &scales);
        let (w64, w64_shifted) = (w.exact_f64(), w.with_shifted_scales().exact_f64());
        let want = grouped_f64(&a64, &w64, &off, n, kk);
        let wrong_a = grouped_f64(&a64_shifted, &w64, &off, n, kk);
        let wrong_w = grouped_f64(&a64, &w64_shifted, &off, n, kk);
        let w8 = w.upload();
        for sched in Sm90Schedule::W8A8 {
            let c = nan_bf16(rows * n);
            let p = GroupedGemm { a: GroupedInput::Fp8(act), w: fp8_mats(&w8), c: c.slice(), n, k: kk };
            k.grouped_gemm.gemm_with(s, &p, &r, sched).unwrap();
            dev.gpu.sync().unwrap();
            let got = down_bf16(c.slice());
            let (err, err_a, err_w) = (rel64(&got, &want), rel64(&got, &wrong_a), rel64(&got, &wrong_w));
            println!("W8A8 {sched:?} GEMM [{n}, {kk}]: rel {err:.2e}; misread act scales {err_a:.2e}, weight scales {err_w:.2e}");
            // f32 sums of exact products, rounded to bf16 (2^-9 relative at most).
            assert!(err < 3e-3, "W8A8 {sched:?} GEMM [{n}, {kk}]: off the f64 product ({err})");
            assert!(err_a > 5e-2 && err_w > 5e-2, "W8A8 {sched:?} GEMM [{n}, {kk}]: misread scales would pass");
        }
    }
    // Gate/up with SiLU·mul: I = 256 (two blocks each for gate and up), K = 208; I = 128, K = 336.
    let bf = |x: f64| bf16::from_f64(x).to_f64();
    for (inter, kk) in [(256usize, 208usize), (128, 336)] {
        let w = Fp8Stack::random(&mut rng, e, 2 * inter, kk);
        let (act_in, a64, _) = quantized_act(&dev, &mut rng, rows, kk, &q, &scales);
        let gu = grouped_f64(&a64, &w.exact_f64(), &off, 2 * inter, kk);
        let want: Vec<f64> = (0..rows * inter)
            .map(|i| {
                let (row, j) = (i / inter, i % inter);
                let (g, u) = (bf(gu[row * 2 * inter + j]), bf(gu[row * 2 * inter + inter + j]));
                bf(bf(g / (1.0 + (-g).exp())) * u)
            })
            .collect();
        let w8 = w.upload();
        for sched in Sm90Schedule::W8A8 {
            let act = nan_bf16(rows * inter);
            let p = GroupedGateUp {
                a: GroupedInput::Fp8(act_in),
                w: fp8_mats(&w8),
                gate_up: act.slice(),
                act: act.slice(),
                inter,
                k: kk,
            };
            k.grouped_gemm.gate_up_act_with(s, &p, &r, sched).unwrap();
            dev.gpu.sync().unwrap();
            let err = rel64(&down_bf16(act.slice()), &want);
            println!("W8A8 {sched:?} gate/up I={inter} K={kk}: rel {err:.2e}");
            assert!(err < 5e-3, "W8A8 {sched:?} gate/up I={inter} K={kk}: off the f64 reference ({err})");
        }
    }
    // Refusals: W8A8 needs FP8 weights, 128-row tiles and 128-row items.
    let (act, ..) = quantized_act(&dev, &mut rng, rows, 208, &q, &scales);
    let w8 = Fp8Stack::random(&mut rng, e, 128, 208).upload();
    let w16 = up_bf16(&vec![0.0; e * 128 * 208]);
    let c = nan_bf16(rows * 128);
    let refusal = |w: ExpertMats, r: &MoeRouting, sched: Sm90Schedule| {
        let p = GroupedGemm { a: GroupedInput::Fp8(act), w, c: c.slice(), n: 128, k: 208 };
        k.grouped_gemm.gemm_with(s, &p, r, sched).unwrap_err().to_string()
    };
    let w8a8 = Sm90Schedule::W8A8[0];
    assert!(refusal(ExpertMats::Bf16(w16.slice()), &r, w8a8).contains("need block-FP8 weights"));
    let r64 = bufs.routing_tiles(t, e, top, TileM::Rows64);
    assert!(refusal(fp8_mats(&w8), &r64, w8a8).contains("128-row tiles"));
    let items256 = Sm90Schedule { item_rows: 256, persistent: false };
    assert!(refusal(fp8_mats(&w8), &r, items256).contains("items of 128 weight rows"));
    dev.gpu.sync().unwrap();
}

/// One small-step MoE shape: hidden, routed width, experts, top-k, shared pieces.
struct GemvCase {
    hidden: usize,
    inter: usize,
    experts: usize,
    top: usize,
    pieces: usize,
}

fn bf(x: f64) -> f64 {
    bf16::from_f64(x).to_f64()
}

fn dot(w: &[f64], x: &[f32]) -> f64 {
    w.iter().zip(x).map(|(a, b)| a * *b as f64).sum()
}

/// The kernels' math in f64 with their bf16 rounding points, for `t` tokens: (act, act_shared,
/// out). `gu`, `dn`: routed [E, 2I, H] and [E, H, I]; `sgu`, `sdn`: shared [2Is, H], [H, Is].
#[allow(clippy::too_many_arguments)]
fn gemv_reference(
    c: &GemvCase,
    t: usize,
    x: &[f32],
    ids: &[i32],
    wts: &[f32],
    gu: &[f64],
    dn: &[f64],
    sgu: &[f64],
    sdn: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (h, im, top) = (c.hidden, c.inter, c.top);
    let ims = c.pieces * im;
    let silu_mul = |g: f64, u: f64| bf(bf(g / (1.0 + (-g).exp())) * u);
    // act rows over a [2n, H] gate/up matrix at `w`.
    let act_of = |w: &[f64], n: usize, xt: &[f32]| -> Vec<f64> {
        (0..n)
            .map(|j| silu_mul(bf(dot(&w[j * h..(j + 1) * h], xt)), bf(dot(&w[(n + j) * h..(n + j + 1) * h], xt))))
            .collect()
    };
    let (mut act, mut act_sh, mut out) = (vec![], vec![], vec![]);
    for m in 0..t {
        let xt = &x[m * h..(m + 1) * h];
        for j in 0..top {
            let ex = ids[m * top + j] as usize;
            act.extend(act_of(&gu[ex * 2 * im * h..(ex + 1) * 2 * im * h], im, xt));
        }
        if c.pieces > 0 {
            act_sh.extend(act_of(sgu, ims, xt));
        }
        for n in 0..h {
            let mut routed = 0.0;
            for j in 0..top {
                let ex = ids[m * top + j] as usize;
                let row = &dn[(ex * h + n) * im..(ex * h + n + 1) * im];
                let a = &act[(m * top + j) * im..(m * top + j + 1) * im];
                routed += wts[m * top + j] as f64 * bf(row.iter().zip(a).map(|(w, v)| w * v).sum());
            }
            let mut y = bf(routed);
            if c.pieces > 0 {
                let a = &act_sh[m * ims..(m + 1) * ims];
                y += bf(sdn[n * ims..(n + 1) * ims].iter().zip(a).map(|(w, v)| w * v).sum());
            }
            out.push(bf(y));
        }
    }
    (act, act_sh, out)
}

fn rel64(got: &[f32], want: &[f64]) -> f64 {
    assert!(got.iter().all(|v| v.is_finite()), "device output holds NaN or inf (unwritten?)");
    let num: f64 = got.iter().zip(want).map(|(a, b)| (*a as f64 - b).powi(2)).sum();
    (num / want.iter().map(|b| b * b).sum::<f64>().max(1e-300)).sqrt()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn moe_gemv_fp8_matches_an_f64_reference_and_the_bf16_kernels() {
    let dev = device();
    let (s, k) = (dev.stream(), &dev.k);
    let mut rng = Rng::new(73);
    // Hidden sizes ending in partial blocks (400 = 3.125 blocks, 1040 = 8.125), V3's 7168; one
    // to five 128-wide blocks per routed expert (up to 512: the narrow FP8 down kernel); shared
    // experts of 2, 0 and 1 pieces.
    let cases = [
        GemvCase { hidden: 400, inter: 256, experts: 8, top: 3, pieces: 2 },
        GemvCase { hidden: 1040, inter: 128, experts: 5, top: 4, pieces: 0 },
        GemvCase { hidden: 7168, inter: 128, experts: 3, top: 2, pieces: 1 },
        // A TP-8 rank of V3: 8 of 16 experts 256 wide and one shared (the narrow down kernel),
        // and TP-4's 512; then 640 columns, past the narrow kernel's widest.
        GemvCase { hidden: 7168, inter: 256, experts: 16, top: 8, pieces: 1 },
        GemvCase { hidden: 1024, inter: 512, experts: 4, top: 2, pieces: 1 },
        GemvCase { hidden: 1024, inter: 640, experts: 4, top: 2, pieces: 1 },
    ];
    for c in &cases {
        let (h, im, ex, top) = (c.hidden, c.inter, c.experts, c.top);
        let ims = c.pieces * im;
        let tmax = 4;
        let gu = Fp8Stack::random(&mut rng, ex, 2 * im, h);
        let dn = Fp8Stack::random(&mut rng, ex, h, im);
        let sgu = Fp8Stack::random(&mut rng, 1, 2 * ims, h);
        let sdn = Fp8Stack::random(&mut rng, 1, h, ims);
        let x = round(&rng.uniform(tmax * h, 1.0));
        let ids: Vec<i32> = (0..tmax)
            .flat_map(|_| {
                let mut all: Vec<i32> = (0..ex as i32).collect();
                rng.shuffle(&mut all);
                all.truncate(top);
                all
            })
            .collect();
        let wts: Vec<f32> = rng.uniform(tmax * top, 1.0).iter().map(|w| w.abs() + 0.1).collect();
        let exact = [&gu, &dn, &sgu, &sdn].map(|w| w.exact_f64());
        let (act_want, sh_want, out_want) =
            gemv_reference(c, tmax, &x, &ids, &wts, &exact[0], &exact[1], &exact[2], &exact[3]);
        // The same kernels' math with the scale grids read one block off: must not pass.
        let shifted = [&gu, &dn, &sgu, &sdn].map(|w| w.with_shifted_scales().exact_f64());
        let (_, _, out_wrong) =
            gemv_reference(c, tmax, &x, &ids, &wts, &shifted[0], &shifted[1], &shifted[2], &shifted[3]);
        let dev_fp8 = [&gu, &dn, &sgu, &sdn].map(|w| w.upload());
        let dev_bf16 = [&gu, &dn, &sgu, &sdn].map(|w| up_bf16(&w.dequant_f32()));
        let (d_x, d_ids, d_w) = (up_bf16(&x), up(&ids), up(&wts));
        for t in 1..=tmax {
            let run = |mats: [ExpertMats; 4], gate_up: GateUpKernel| {
                let (act, act_sh, out) = (nan_bf16(t * top * im), nan_bf16((t * ims).max(1)), nan_bf16(t * h));
                let p = MoeGemvExperts {
                    tokens: t,
                    top_k: top,
                    hidden: h,
                    inter: im,
                    shared_pieces: c.pieces,
                    x: d_x.slice(),
                    topk_ids: d_ids.slice(),
                    topk_w: d_w.slice(),
                    gate_up: mats[0],
                    down: mats[1],
                    shared: (c.pieces > 0).then_some((mats[2], mats[3])),
                    act: act.slice(),
                    act_shared: act_sh.slice(),
                    out: out.slice(),
                };
                k.moe_gemv.experts_with(s, &p, gate_up).unwrap();
                dev.gpu.sync().unwrap();
                (down_bf16(act.slice()), down_bf16(act_sh.slice()), down_bf16(out.slice()))
            };
            let (_, _, out_bf16) = run(dev_bf16.each_ref().map(|w| ExpertMats::Bf16(w.slice())), GateUpKernel::Warp);
            // Every FP8 gate/up kernel (the streaming one on sm_90a), each against the reference;
            // the five-block warp kernel gives the warp kernel's bits.
            let warp = run(dev_fp8.each_ref().map(fp8_mats), GateUpKernel::Warp);
            let five = run(dev_fp8.each_ref().map(fp8_mats), GateUpKernel::WarpFiveBlocks);
            assert!(
                warp.0.iter().zip(&five.0).all(|(a, b)| a.to_bits() == b.to_bits())
                    && warp.1.iter().zip(&five.1).all(|(a, b)| a.to_bits() == b.to_bits())
                    && warp.2.iter().zip(&five.2).all(|(a, b)| a.to_bits() == b.to_bits()),
                "H={h} t={t}: the five-block gate/up differs from the warp kernel"
            );
            for gate_up in [GateUpKernel::Warp, GateUpKernel::WarpFiveBlocks, GateUpKernel::Stream] {
                let (act, act_sh, out) = run(dev_fp8.each_ref().map(fp8_mats), gate_up);
                let e_act = rel64(&act, &act_want[..t * top * im]);
                let e_sh = if c.pieces > 0 { rel64(&act_sh[..t * ims], &sh_want[..t * ims]) } else { 0.0 };
                let e_out = rel64(&out, &out_want[..t * h]);
                let e_wrong = rel64(&out, &out_wrong[..t * h]);
                let out_bf16_64: Vec<f64> = out_bf16.iter().map(|&v| v as f64).collect();
                let e_bf16 = rel64(&out, &out_bf16_64);
                println!(
                    "moe gemv fp8 {gate_up:?} H={h} I={im} E={ex} top {top} pieces {} t={t}: act {e_act:.2e} shared \
                 {e_sh:.2e} out {e_out:.2e}; vs bf16 kernels {e_bf16:.2e}; vs shifted scales {e_wrong:.2e}",
                    c.pieces
                );
                // f32 sums in another order than f64 on the same operands: only rare one-ulp flips
                // at the bf16 rounding points separate them.
                assert!(e_act < 1e-3 && e_sh < 1e-3 && e_out < 1e-3, "H={h} t={t}: off the f64 reference");
                // bf16-rounded weights: about 2^-9 relative per weight.
                assert!(e_bf16 < 2e-2, "H={h} t={t}: off the bf16 kernels on dequantized weights ({e_bf16})");
                assert!(e_wrong > 5e-2, "H={h} t={t}: a misread scale grid would pass ({e_wrong})");
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn moe_gemv_refuses_mixed_formats_and_unstackable_fp8_widths() {
    let dev = device();
    let (s, k) = (dev.stream(), &dev.k);
    let mut rng = Rng::new(79);
    let (h, e, top) = (256usize, 4usize, 2usize);
    let mut bufs = |im: usize| {
        let w8 = [(e, 2 * im, h), (e, h, im), (1, 2 * im, h), (1, h, im)]
            .map(|(n, r, c)| Fp8Stack::random(&mut rng, n, r, c).upload());
        let w16 = w8.each_ref().map(|w| up_bf16(&vec![0.0; w.0.len()]));
        (w8, w16)
    };
    let (x, ids, wts) = (up_bf16(&vec![0.0; h]), up(&[0i32, 1]), up(&[0.5f32, 0.5]));
    let scratch = nan_bf16(4 * 4 * h);
    let params = |im: usize, m: [ExpertMats<'_>; 4]| -> String {
        let p = MoeGemvExperts {
            tokens: 1,
            top_k: top,
            hidden: h,
            inter: im,
            shared_pieces: 1,
            x: x.slice(),
            topk_ids: ids.slice(),
            topk_w: wts.slice(),
            gate_up: m[0],
            down: m[1],
            shared: Some((m[2], m[3])),
            act: scratch.slice(),
            act_shared: scratch.slice(),
            out: scratch.slice(),
        };
        k.moe_gemv.experts(s, &p).map_or_else(|e| e.to_string(), |_| "ok".into())
    };
    let (w8, w16) = bufs(128);
    let f = |i: usize| fp8_mats(&w8[i]);
    let b = |i: usize| ExpertMats::Bf16(w16[i].slice());
    assert!(params(128, [f(0), f(1), b(2), b(3)]).contains("all be bf16 or all block-FP8"));
    assert!(params(128, [f(0), b(1), f(2), f(3)]).contains("all be bf16 or all block-FP8"));
    let (w8, _) = bufs(64);
    let f = |i: usize| fp8_mats(&w8[i]);
    assert!(params(64, [f(0), f(1), f(2), f(3)]).contains("inter % 128 == 0"));
    dev.gpu.sync().unwrap();
}
