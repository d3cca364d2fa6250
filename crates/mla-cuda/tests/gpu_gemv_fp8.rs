//! The block-FP8 weight-streaming GEMV (`ops::GemvFp8Kernels`) against an f64 reference on the
//! same quantized operands: e4m3 bytes decoded by mla-core's exact decoder, per-block scales
//! spanning four decades (never all ones), partial scale blocks in both dimensions (V3's
//! kv_a_proj has 576 rows, 4.5 blocks; K = 1360 ends in a partial block), both kernels (FMA, 1 to
//! 4 input rows; tensor-core MMA, 1 to 8), and the refusal of 5 rows by the FMA one.
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_gemv_fp8 -- --ignored`.

mod common;

use common::*;
use mla_core::model::fp8::{dequantize_block_fp8, scale_grid};
use mla_cuda::ops::{Fp8GemvKind, Fp8Linear, GemvOut, Strided, FP8_BLOCK, FP8_GEMV_MAX_ROWS, GEMV_KERNEL_MAX_ROWS};

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
            // The FMA kernel takes up to GEMV_KERNEL_MAX_ROWS rows, the MMA one FP8_GEMV_MAX_ROWS.
            for kind in Fp8GemvKind::ALL.into_iter().filter(|&k| k == Fp8GemvKind::Mma || m <= GEMV_KERNEL_MAX_ROWS) {
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
