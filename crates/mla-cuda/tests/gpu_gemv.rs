//! The small-batch GEMV kernel (`ops::GemvKernels`, as `model::small_linear` runs it) against an f64 reference computed on the host from
//! the same bf16 values, next to cuBLAS on the same inputs, for the V2-Lite linear shapes.
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_gemv -- --ignored`.

mod common;

use common::*;
use half::bf16;
use mla_cuda::gpu::DeviceBuffer;
use mla_cuda::model::small_linear::SmallLinear;
use mla_cuda::model::weights::Fp8Share;
use mla_cuda::ops::{Linear, Proj, Strided, GEMV_KERNEL_MAX_ROWS};

fn reference(w: &[f32], x: &[f32], n: usize, k: usize, m: usize, x_stride: usize) -> Vec<f64> {
    let mut y = vec![0f64; m * n];
    for r in 0..m {
        for j in 0..n {
            y[r * n + j] = (0..k).map(|i| w[j * k + i] as f64 * x[r * x_stride + i] as f64).sum();
        }
    }
    y
}

fn rel(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemv_matches_an_f64_reference_and_cublas_on_v2_lite_shapes() {
    let dev = device();
    let mut gemv = SmallLinear::new(true, &Fp8Share::default(), 4, false).unwrap();
    gemv.max_rows = GEMV_KERNEL_MAX_ROWS;
    let mut rng = Rng::new(21);
    // (out, in): q_proj, kv_a, o_proj, shared gate_up, shared down, dense down, lm_head slice;
    // then a rank's shards under tensor parallelism: at TP 8 q_proj, o_proj, shared gate_up and
    // down, dense gate_up and down (K = 1368 is not a multiple of 64), and at TP 2 dense down.
    let one_gpu =
        [(3072, 2048), (576, 2048), (2048, 2048), (5632, 2048), (2048, 2816), (2048, 10944), (12800, 2048), (13, 24)];
    let tp_ranks = [(384, 2048), (2048, 256), (704, 2048), (2048, 352), (2736, 2048), (2048, 1368), (2048, 5472)];
    for (n, k) in one_gpu.into_iter().chain(tp_ranks) {
        let w = round(&rng.uniform(n * k, 0.05));
        let wd = up_bf16(&w);
        let lin = Linear::new(wd.slice(), n, k);
        for m in 1..=4 {
            // Rows of x sit at a stride wider than k, as the workspace's do.
            let stride = k + 8;
            let x = round(&rng.uniform(m * stride, 1.0));
            let xd = up_bf16(&x);
            let want = reference(&w, &x, n, k, m, stride);
            // Poisoned outputs: every element must be written.
            let y16 = up_bf16(&vec![f32::NAN; m * n]);
            let y32 = up(&vec![f32::NAN; m * n]);
            let x = Strided::new(xd.slice(), stride);
            gemv.linear(&dev, &Proj::Bf16(lin), x, m, Strided::new(y16.slice(), n)).unwrap();
            gemv.linear_f32_out(&dev, &lin, x, m, Strided::new(y32.slice(), n)).unwrap();
            let blas16: DeviceBuffer<bf16> = up_bf16(&vec![f32::NAN; m * n]);
            dev.blas.linear(&lin, x, m, Strided::new(blas16.slice(), n)).unwrap();
            dev.gpu.sync().unwrap();
            let (g16, g32, b16) = (down_bf16(y16.slice()), down(y32.slice()), down_bf16(blas16.slice()));
            let (e16, e32, eb) = (rel(&g16, &want), rel(&g32, &want), rel(&b16, &want));
            println!("[{n}, {k}] x {m}: gemv bf16 {e16:.2e}, f32 {e32:.2e}; cuBLAS bf16 {eb:.2e}");
            assert!(g16.iter().chain(&g32).all(|v| v.is_finite()), "[{n}, {k}] x {m}: unwritten outputs");
            // f32 accumulation in another order: far under bf16 rounding of the output (2^-9).
            assert!(e32 < 1e-5, "[{n}, {k}] x {m}: f32 output rel {e32}");
            assert!(e16 < 4e-3 && e16 < 2.0 * eb + 1e-4, "[{n}, {k}] x {m}: bf16 output rel {e16} (cuBLAS {eb})");
        }
    }
}

/// q_proj and kv_a in one launch (`SmallLinear::linear_pair`): each output against the f64 reference.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn paired_gemv_writes_both_outputs() {
    let dev = device();
    let gemv = SmallLinear::new(true, &Fp8Share::default(), 4, false).unwrap();
    let mut rng = Rng::new(22);
    let k = 2048;
    let (na, nb) = (3072, 576);
    let (wa, wb) = (round(&rng.uniform(na * k, 0.05)), round(&rng.uniform(nb * k, 0.05)));
    let (da, db) = (up_bf16(&wa), up_bf16(&wb));
    let (la, lb) = (Linear::new(da.slice(), na, k), Linear::new(db.slice(), nb, k));
    let x = round(&rng.uniform(k, 1.0));
    let xd = up_bf16(&x);
    let (ya, yb) = (up_bf16(&vec![f32::NAN; na]), up_bf16(&vec![f32::NAN; nb]));
    let x_rows = Strided::new(xd.slice(), k);
    let (out_a, out_b) = (Strided::new(ya.slice(), na), Strided::new(yb.slice(), nb));
    gemv.linear_pair(&dev, x_rows, 1, (&Proj::Bf16(la), out_a), (&Proj::Bf16(lb), out_b)).unwrap();
    dev.gpu.sync().unwrap();
    for (name, got, w, n) in [("a", down_bf16(ya.slice()), &wa, na), ("b", down_bf16(yb.slice()), &wb, nb)] {
        let e = rel(&got, &reference(w, &x, n, k, 1, k));
        println!("paired gemv {name} [{n}, {k}]: rel {e:.2e}");
        assert!(got.iter().all(|v| v.is_finite()) && e < 4e-3, "paired gemv output {name}: rel {e}");
    }
}
