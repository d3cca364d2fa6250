//! The W8A8 path of FP8 projections (`model::small_linear` on Hopper): the activation quantizer
//! bit for bit against mla-core's block quantizer on 1x128 blocks (also gathering rows, as the
//! MoE layer's W8A8 experts take them), and the projection (quantizer +
//! cuBLASLt's block-scaled GEMM on rows up to a multiple of 4, the W8A16 GEMV on the rest) against
//! an f64 product of the same operands, rounded to bf16 as the output is: weights with block
//! scales over four decades, rows 4 to 300 (partial 128-row tiles), N with a partial block (576 rows = 4.5 blocks), K ending in a partial group.
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_fp8_gemm -- --ignored`.

mod common;

use common::*;
use mla_core::model::fp8::{dequantize_block_fp8, quantize_block_fp8, scale_grid, DEEPSEEK_BLOCK};
use mla_cuda::model::small_linear::SmallLinear;
use mla_cuda::model::weights::Fp8Share;
use mla_cuda::ops::{fp8_lt_scale_ld, Fp8Act, Fp8Linear, Proj, Strided, FP8_BLOCK, FP8_GEMV_MAX_ROWS};

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn w8a8_projection_matches_f64_on_the_quantized_operands() {
    let dev = device();
    if dev.gpu.info.compute_capability != (9, 0) {
        println!("SKIPPED: cuBLASLt's block-scaled FP8 GEMM needs sm_90");
        return;
    }
    let mut rng = Rng::new(51);
    // (out, in): V3's kv_a (576: 4.5 blocks), q_b, o_proj at TP8, V2-Lite's dense down (K =
    // 10944: 85.5 groups), a small one.
    for (n, k) in [(576, 7168), (3072, 1536), (7168, 2048), (2048, 10944), (256, 384)] {
        let [gr, gc] = scale_grid(n, k, DEEPSEEK_BLOCK);
        let mags: Vec<f32> =
            rng.uniform(gr * gc, 2.0).iter().map(|u| 10f32.powf(u - 1.0) / (k as f32).sqrt()).collect();
        let u = rng.uniform(n * k, 1.0);
        let w: Vec<f32> = (0..n * k).map(|i| mags[(i / k / FP8_BLOCK) * gc + (i % k) / FP8_BLOCK] * u[i]).collect();
        let wq = quantize_block_fp8(&w, n, k, DEEPSEEK_BLOCK);
        let wf = wq.dequantize();
        let (wd, sd) = (up(&wq.data), up(&wq.scale_inv));
        let lin = Fp8Linear { w: wd.slice(), scale_inv: sd.slice(), out: n, inp: k };
        // cuBLASLt's copy of the grid, rows padded to a multiple of 4 scales (zeros).
        let ld = fp8_lt_scale_ld(k);
        let padded: Vec<f32> =
            (0..gr * ld).map(|i| if i % ld < gc { wq.scale_inv[i / ld * gc + i % ld] } else { 0.0 }).collect();
        let lt = up(&padded);
        let share = Fp8Share { matrices: 1, largest_projection: n * k, widest_input: k, ..Default::default() };
        let max_rows = 300;
        let linear = SmallLinear::new(true, &share, max_rows, true).unwrap();
        // 4 and 8 rows: the GEMV alone (FMA, MMA); 9 and 11: cuBLASLt on 8 rows and the GEMV on
        // the rest.
        for m in [4, 8, 9, 11, 64, 129, 300] {
            let stride = k + 8;
            // Each row and 128-column group at its own magnitude, 10^[-1, 1): a mixed-up
            // activation scale layout shows as a large error.
            let mag = rng.uniform(m * gc, 1.0);
            let x: Vec<f32> = rng
                .uniform(m * stride, 2.0)
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let (r, c) = (i / stride, (i % stride).min(k - 1));
                    v * 10f32.powf(mag[r * gc + c / FP8_BLOCK])
                })
                .collect();
            let x = round(&x);
            let xd = up_bf16(&x);
            let xs = Strided::new(xd.slice(), stride);
            // The quantizer alone, bit for bit.
            let packed: Vec<f32> = (0..m).flat_map(|r| x[r * stride..r * stride + k].to_vec()).collect();
            let want_q = quantize_block_fp8(&packed, m, k, [1, FP8_BLOCK]);
            let groups = k.div_ceil(FP8_BLOCK);
            let (qd, qs) = (up(&vec![0u8; m * k]), up(&vec![f32::NAN; groups * m]));
            let act = Fp8Act { q: qd.slice(), scales: qs.slice(), scale_ld: m };
            dev.k.fp8_convert.quantize_act(dev.stream(), xs, m, k, &act).unwrap();
            let yd = up_bf16(&vec![f32::NAN; m * n]);
            linear
                .linear(&dev, &Proj::Fp8 { w: lin, lt_scales: lt.slice() }, xs, m, Strided::new(yd.slice(), n))
                .unwrap();
            dev.gpu.sync().unwrap();
            let (got_q, got_s) = (down(qd.slice()), down(qs.slice()));
            let bytes_differ = got_q.iter().zip(&want_q.data).filter(|(a, b)| a != b).count();
            let scales_differ = (0..m * groups)
                .filter(|&i| got_s[(i % groups) * m + i / groups].to_bits() != want_q.scale_inv[i].to_bits())
                .count();
            assert_eq!(
                (bytes_differ, scales_differ),
                (0, 0),
                "[{m}, {k}]: quantized activations differ from mla-core's"
            );
            // Gathered and quantized in one pass (the MoE layer's expert inputs): rows picked
            // out of order, some twice, bit for bit as mla-core quantizes the gathered rows; read
            // at a row stride that is not a multiple of 4 (the kernel's one-value-at-a-time path,
            // where the quantizer above took 8-byte loads).
            let odd = k + 2;
            let x_odd: Vec<f32> = (0..m * odd).map(|i| packed[i / odd * k + (i % odd).min(k - 1)]).collect();
            let x_odd_d = up_bf16(&x_odd);
            let xs_odd = Strided::new(x_odd_d.slice(), odd);
            let src: Vec<i32> = (0..m).map(|r| ((r * 7 + 3) % m) as i32 / 2 * 2).collect();
            let gathered: Vec<f32> =
                src.iter().flat_map(|&r| packed[r as usize * k..(r as usize + 1) * k].to_vec()).collect();
            let want_g = quantize_block_fp8(&gathered, m, k, [1, FP8_BLOCK]);
            let (gq, gs) = (up(&vec![0u8; m * k]), up(&vec![f32::NAN; groups * m]));
            let gact = Fp8Act { q: gq.slice(), scales: gs.slice(), scale_ld: m };
            let d_src = up(&src);
            dev.k.fp8_convert.quantize_act_gather(dev.stream(), xs_odd, d_src.slice(), m, k, &gact).unwrap();
            dev.gpu.sync().unwrap();
            let (got_gq, got_gs) = (down(gq.slice()), down(gs.slice()));
            let gathered_differ = got_gq.iter().zip(&want_g.data).filter(|(a, b)| a != b).count()
                + (0..m * groups)
                    .filter(|&i| got_gs[(i % groups) * m + i / groups].to_bits() != want_g.scale_inv[i].to_bits())
                    .count();
            assert_eq!(gathered_differ, 0, "[{m}, {k}]: gathered quantization differs from mla-core's");
            // The projection against f64 on the same quantized operands, rounded to bf16: the
            // rows up to a multiple of 4 with quantized activations (cuBLASLt), the others as the
            // W8A16 GEMV takes them.
            let xq = dequantize_block_fp8(&want_q.data, m, k, &want_q.scale_inv, [1, FP8_BLOCK]);
            let main = if m <= FP8_GEMV_MAX_ROWS { 0 } else { m / 4 * 4 };
            let want: Vec<f32> = (0..m * n)
                .map(|i| {
                    let (r, j) = (i / n, i % n);
                    let xr = |c: usize| if r < main { xq[r * k + c] } else { packed[r * k + c] };
                    let v: f64 = (0..k).map(|c| wf[j * k + c] as f64 * xr(c) as f64).sum();
                    half::bf16::from_f64(v).to_f32()
                })
                .collect();
            let got = down_bf16(yd.slice());
            assert!(got.iter().all(|v| v.is_finite()), "[{m}x{k}]·[{n}x{k}]ᵀ: unwritten outputs");
            let num: f64 = got.iter().zip(&want).map(|(a, b)| (a - b).abs() as f64).sum();
            let den: f64 = want.iter().map(|b| b.abs() as f64).sum();
            println!("W8A8 [{m}, {k}] x [{n}, {k}]: mean rel error {:.2e} vs f64 rounded to bf16", num / den);
            assert!(num / den < 1e-3, "W8A8 [{m}, {k}] x [{n}, {k}]: mean rel error {}", num / den);
        }
    }
}

/// What `SmallLinear` relies on: cuBLASLt's block-scaled FP8 GEMM, given weight scale rows padded
/// to a multiple of 4 (`fp8_lt_scale_ld`), takes row counts that are multiples of 4 (with K
/// ending in a partial group, N in a partial block, K of 2 groups only) and refuses others; a
/// refusal is an error, never a wrong result.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cublaslt_takes_rows_in_multiples_of_four() {
    let dev = device();
    if dev.gpu.info.compute_capability != (9, 0) {
        return;
    }
    let shapes: [(usize, usize, usize); 9] = [
        (4, 576, 7168),
        (8, 576, 7168),
        (12, 576, 7168),
        (8, 256, 256),
        (8, 320, 384),
        (64, 256, 256),
        (8, 2048, 10944),
        (8, 2048, 1408),
        (6, 576, 7168),
    ];
    for (m, n, k) in shapes {
        let (kb, nb) = (k.div_ceil(FP8_BLOCK), n.div_ceil(FP8_BLOCK));
        // All ones: e4m3 0x38 is 1.0, so every output is K.
        let (x, xs) = (up(&vec![0x38u8; m * k]), up(&vec![1.0f32; kb * m]));
        // The weight grid with cuBLASLt's padded rows (ones in the padding too: they scale nothing).
        let (w, ws) = (up(&vec![0x38u8; n * k]), up(&vec![1.0f32; nb * fp8_lt_scale_ld(k)]));
        let y = up_bf16(&vec![0.0; m * n]);
        let g = mla_cuda::gpu::Fp8BlockGemm {
            rows: m,
            out: n,
            inp: k,
            x: x.slice().ptr,
            x_scales: xs.slice().ptr,
            x_scale_ld: m,
            w: w.slice().ptr,
            w_scales: ws.slice().ptr,
            y: y.slice().ptr,
            y_stride: n,
        };
        let r = dev.blas_lt.fp8_block_gemm(dev.stream(), &g).and_then(|_| dev.gpu.sync());
        println!(
            "cuBLASLt block-scaled M={m} N={n} K={k}: {}",
            r.as_ref().map_or_else(|e| e.to_string(), |_| "ok".into())
        );
        if m % 4 == 0 {
            r.unwrap();
            let got = down_bf16(y.slice());
            assert!(got.iter().all(|&v| v == k as f32), "M={m} N={n} K={k}: outputs other than {k}");
        } else {
            assert!(r.is_err(), "M={m}: cuBLASLt now takes row counts that are not multiples of 4; revisit the split");
        }
    }
}
