//! The block-FP8 weight-streaming GEMV (`ops::GemvFp8Kernels`) against an f64 reference on the
//! same quantized operands: e4m3 bytes decoded by mla-core's exact decoder, per-block scales
//! spanning four decades (never all ones), partial scale blocks in both dimensions (V3's
//! kv_a_proj has 576 rows, 4.5 blocks; K = 1360 ends in a partial block), the three kernels (FMA,
//! 1 to 4 input rows; tensor-core MMA and streaming, 1 to 8), every streaming variant at 1 to 8
//! K splits (bit-identical across runs), every e4m3 code through the streaming kernel's integer
//! conversion (exact), and the refusal of 5 rows by the FMA one.
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_gemv_fp8 -- --ignored`.

mod common;

use common::*;
use mla_core::model::fp8::{dequantize_block_fp8, scale_grid};
use mla_cuda::ops::{
    Fp8GemvKind, Fp8Linear, GemvOut, StreamConfig, Strided, FP8_BLOCK, FP8_GEMV_MAX_ROWS, GEMV_KERNEL_MAX_ROWS,
    STREAM_VARIANTS,
};

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_gemv_matches_an_f64_reference_with_partial_blocks() {
    let dev = device();
    let mut rng = Rng::new(31);
    // (out, in): V3's kv_a_proj_with_mqa (576 rows: 4.5 blocks), q_a_proj, the two fused, a
    // K ending in a partial block, and a tiny odd shape.
    for (n, k) in [(576, 7168), (1536, 7168), (2112, 7168), (384, 1360), (13, 48)] {
        let bytes = fp8_bytes(&mut rng, n * k);
        let [gr, gc] = scale_grid(n, k, [FP8_BLOCK, FP8_BLOCK]);
        let scales = fp8_scales(&mut rng, gr * gc);
        let w = dequantize_block_fp8(&bytes, n, k, &scales, [FP8_BLOCK, FP8_BLOCK]);
        let (wd, sd) = (up(&bytes), up(&scales));
        let lin = Fp8Linear { w: wd.slice(), scale_inv: sd.slice(), out: n, inp: k };
        for m in 1..=FP8_GEMV_MAX_ROWS {
            let stride = k + 8;
            let x = round(&rng.uniform(m * stride, 1.0));
            let xd = up_bf16(&x);
            let want: Vec<f64> = (0..m * n)
                .map(|i| {
                    let (r, j) = (i / n, i % n);
                    (0..k).map(|c| w[j * k + c] as f64 * x[r * stride + c] as f64).sum()
                })
                .collect();
            // The FMA kernel takes up to GEMV_KERNEL_MAX_ROWS rows, the others FP8_GEMV_MAX_ROWS.
            for kind in Fp8GemvKind::ALL.into_iter().filter(|&k| k != Fp8GemvKind::Fma || m <= GEMV_KERNEL_MAX_ROWS) {
                let (y32, y16) = (up(&vec![f32::NAN; m * n]), up_bf16(&vec![f32::NAN; m * n]));
                let xs = Strided::new(xd.slice(), stride);
                let g = &dev.k.gemv_fp8;
                g.launch_with(kind, dev.stream(), &lin, xs, m, GemvOut::F32(Strided::new(y32.slice(), n))).unwrap();
                g.launch_with(kind, dev.stream(), &lin, xs, m, GemvOut::Bf16(Strided::new(y16.slice(), n))).unwrap();
                dev.gpu.sync().unwrap();
                let (g32, g16) = (down(y32.slice()), down_bf16(y16.slice()));
                let rel = |got: &[f32]| {
                    assert!(got.iter().all(|v| v.is_finite()), "[{n}, {k}] x {m}: unwritten or non-finite outputs");
                    let num: f64 = got.iter().zip(&want).map(|(a, b)| (*a as f64 - b).powi(2)).sum();
                    (num / want.iter().map(|b| b * b).sum::<f64>()).sqrt()
                };
                let (e32, e16) = (rel(&g32), rel(&g16));
                println!("fp8 gemv {kind:?} [{n}, {k}] x {m}: f32 out rel {e32:.2e}, bf16 out rel {e16:.2e}");
                // f32 accumulation in another order on exactly the reference's operands.
                assert!(e32 < 1e-5, "{kind:?} [{n}, {k}] x {m}: f32 output rel {e32}");
                assert!(e16 < 4e-3, "{kind:?} [{n}, {k}] x {m}: bf16 output rel {e16}");
            }
        }
    }
    let (wd, sd) = (up(&vec![0u8; 16 * 16]), up(&[1f32]));
    let lin = Fp8Linear { w: wd.slice(), scale_inv: sd.slice(), out: 16, inp: 16 };
    let (xd, yd) = (up_bf16(&vec![0.0; 5 * 16]), up_bf16(&vec![0.0; 5 * 16]));
    let (xs, ys) = (Strided::new(xd.slice(), 16), GemvOut::Bf16(Strided::new(yd.slice(), 16)));
    let err = dev.k.gemv_fp8.launch_with(Fp8GemvKind::Fma, dev.stream(), &lin, xs, 5, ys).unwrap_err().to_string();
    assert!(err.contains("at most 4 rows"), "{err}");
}

/// Every streaming variant at 1, 2, 3 and 8 K splits (3 leaves the last split short, 8 on K = 1360
/// leaves three of them empty), with and without the L2 prefetch, against the f64 reference; the
/// same launch twice gives the same bits (the split-K sum has a fixed order).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_gemv_stream_variants_and_splits_match_the_reference() {
    let dev = device();
    if !dev.k.gemv_fp8.has_stream() {
        println!("no streaming kernel on this GPU (sm_90 only): skipped");
        return;
    }
    let mut rng = Rng::new(77);
    for (n, k) in [(576, 7168), (2112, 7168), (384, 1360), (13, 48), (200, 2048)] {
        let bytes = fp8_bytes(&mut rng, n * k);
        let [gr, gc] = scale_grid(n, k, [FP8_BLOCK, FP8_BLOCK]);
        let scales = fp8_scales(&mut rng, gr * gc);
        let w = dequantize_block_fp8(&bytes, n, k, &scales, [FP8_BLOCK, FP8_BLOCK]);
        let (wd, sd) = (up(&bytes), up(&scales));
        let lin = Fp8Linear { w: wd.slice(), scale_inv: sd.slice(), out: n, inp: k };
        for m in [1, 3, 8] {
            let stride = k + 16;
            let x = round(&rng.uniform(m * stride, 1.0));
            let xd = up_bf16(&x);
            let want: Vec<f64> = (0..m * n)
                .map(|i| {
                    let (r, j) = (i / n, i % n);
                    (0..k).map(|c| w[j * k + c] as f64 * x[r * stride + c] as f64).sum()
                })
                .collect();
            let den: f64 = want.iter().map(|b| b * b).sum();
            // Rows of the output at a stride past N, so that a write past row N would show.
            let ys = n + 24;
            for (variant, v) in STREAM_VARIANTS.iter().enumerate() {
                for (si, splits) in [1usize, 2, 3, 8].into_iter().enumerate() {
                    let cfg = StreamConfig { variant, splits, prefetch: si % 2 == 0 };
                    let run = || {
                        let y = up(&vec![f32::NAN; m * ys]);
                        let xs = Strided::new(xd.slice(), stride);
                        let out = GemvOut::F32(Strided::new(y.slice(), ys));
                        dev.k.gemv_fp8.launch_stream(cfg, dev.stream(), &lin, xs, m, out).unwrap();
                        dev.gpu.sync().unwrap();
                        down(y.slice())
                    };
                    let (a, b) = (run(), run());
                    let name = v.name();
                    assert!(
                        a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "{name} x{splits} [{n}, {k}] x {m}: two runs differ"
                    );
                    let mut num = 0f64;
                    for r in 0..m {
                        for j in 0..ys {
                            let got = a[r * ys + j];
                            if j < n {
                                assert!(got.is_finite(), "{name} x{splits} [{n}, {k}] x {m}: ({r}, {j}) unwritten");
                                num += (got as f64 - want[r * n + j]).powi(2);
                            } else {
                                assert!(got.is_nan(), "{name} x{splits} [{n}, {k}] x {m}: wrote ({r}, {j}) past N");
                            }
                        }
                    }
                    let e = (num / den).sqrt();
                    println!("fp8 gemv stream {name} x{splits} [{n}, {k}] x {m}: f32 out rel {e:.2e}");
                    assert!(e < 1e-5, "{name} x{splits} [{n}, {k}] x {m}: f32 output rel {e}");
                }
            }
        }
    }
}

/// Each of the 254 non-NaN e4m3 codes through the streaming kernel's integer conversion, exactly:
/// row j of W holds code j in all of its 256 columns, x is all ones (and then 2^-30, so that
/// the subnormal codes' products stay normal f32), each scale 1 (and 2^-7): y[j] = 256 x
/// code_j x scale, exact in f32. A flushed subnormal, a lost sign or a wrong exponent shows.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_gemv_stream_converts_every_e4m3_code_exactly() {
    let dev = device();
    if !dev.k.gemv_fp8.has_stream() {
        println!("no streaming kernel on this GPU (sm_90 only): skipped");
        return;
    }
    let (n, k) = (256, 256);
    let codes: Vec<u8> = (0..n).map(|j| if j & 0x7f == 0x7f { 0 } else { j as u8 }).collect();
    let bytes: Vec<u8> = (0..n * k).map(|i| codes[i / k]).collect();
    for (xv, sv) in [(1.0f32, 1.0f32), (2f32.powi(-30), 2f32.powi(-7))] {
        let scales = vec![sv; 4];
        let w = dequantize_block_fp8(&bytes, n, k, &scales, [FP8_BLOCK, FP8_BLOCK]);
        let (wd, sd) = (up(&bytes), up(&scales));
        let lin = Fp8Linear { w: wd.slice(), scale_inv: sd.slice(), out: n, inp: k };
        let xd = up_bf16(&vec![xv; k]);
        for (variant, v) in STREAM_VARIANTS.iter().enumerate() {
            for splits in [1, 2] {
                let y = up(&vec![f32::NAN; n]);
                let cfg = StreamConfig { variant, splits, prefetch: false };
                let out = GemvOut::F32(Strided::new(y.slice(), n));
                dev.k.gemv_fp8.launch_stream(cfg, dev.stream(), &lin, Strided::new(xd.slice(), k), 1, out).unwrap();
                dev.gpu.sync().unwrap();
                let got = down(y.slice());
                for j in 0..n {
                    let want = (w[j * k] as f64 * xv as f64 * k as f64) as f32;
                    // == (not the bits): -0 codes sum to +0.
                    assert!(
                        got[j] == want,
                        "code {:#04x}: {} against {want} ({}, x{splits}, x = {xv})",
                        codes[j],
                        got[j],
                        v.name()
                    );
                }
            }
        }
    }
}
