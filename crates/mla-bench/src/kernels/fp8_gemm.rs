//! The FP8 projections of steps past the GEMV's rows on DeepSeek-V3's dense shapes (issue 12):
//! bf16 cuBLAS on the same shape (the yardstick), the W8A8 path (activation quantizer +
//! cuBLASLt's block-scaled GEMM, timed together and the GEMM alone) and the exact W8A16 fallback
//! (dequantize to bf16 + cuBLAS), at M = 64, 512 and 4096 rows, as time and TFLOP/s.

use super::timing::{fill, time_ms};
use half::bf16;
use mla_core::SplitMix64;
use mla_cuda::gpu::{DeviceBuffer, Fp8BlockGemm};
use mla_cuda::model::small_linear::SmallLinear;
use mla_cuda::model::weights::Fp8Share;
use mla_cuda::ops::{Fp8Act, Fp8Linear, Linear, Proj, Strided, FP8_BLOCK};
use mla_cuda::Device;
use serde_json::{json, Value};

/// (name, out, in): the shapes of the GEMV benchmark and of DeepGEMM's table.
const SHAPES: [(&str, usize, usize); 6] = [
    ("q_a+kv_a", 2112, 7168),
    ("q_b", 24576, 1536),
    ("kv_b", 32768, 512),
    ("o_proj", 7168, 16384),
    ("shared_gate_up", 4096, 7168),
    ("shared_down", 7168, 2048),
];
const ROWS: [usize; 3] = [64, 512, 4096];

pub fn run(dev: &Device) -> anyhow::Result<Value> {
    if dev.gpu.info.compute_capability != (9, 0) {
        anyhow::bail!("the block-scaled FP8 GEMM is a Hopper (sm_90) cuBLASLt feature");
    }
    let mut rows_out = vec![];
    let mut rng = SplitMix64::new(71);
    let max_m = *ROWS.iter().max().unwrap_or(&1);
    for (name, n, k) in SHAPES {
        let wb = fill(dev, n * k, 0.02, 80)?;
        let bytes: Vec<u8> = (0..n * k).map(|_| (rng.next_u64() % 255) as u8 & 0xfe).collect();
        let wq = DeviceBuffer::from_host(&bytes)?;
        let grid = n.div_ceil(FP8_BLOCK) * k.div_ceil(FP8_BLOCK);
        let ws = DeviceBuffer::from_host(&vec![1e-3f32; grid])?;
        let lin8 = Fp8Linear { w: wq.slice(), scale_inv: ws.slice(), out: n, inp: k };
        let x = fill(dev, max_m * k, 1.0, 81)?;
        let y = DeviceBuffer::<bf16>::alloc(max_m * n)?;
        let share = Fp8Share { matrices: 1, largest_projection: n * k, widest_input: k, ..Default::default() };
        let w8a8 = SmallLinear::new(true, &share, max_m, true)?;
        let dequant = SmallLinear::new(true, &share, max_m, false)?;
        let q = DeviceBuffer::<u8>::alloc(max_m * k)?;
        let qs = DeviceBuffer::<f32>::alloc(k.div_ceil(FP8_BLOCK) * max_m)?;
        for m in ROWS {
            let xs = Strided::new(x.slice(), k);
            let ys = Strided::new(y.slice(), n);
            let t_bf16 = time_ms(dev, 20, 7, |_| dev.blas.linear(&Linear::new(wb.slice(), n, k), xs, m, ys))?;
            let t_w8a8 = time_ms(dev, 20, 7, |_| w8a8.linear(dev, &Proj::fp8(lin8), xs, m, ys))?;
            let act = Fp8Act { q: q.slice(), scales: qs.slice(), scale_ld: m };
            dev.k.fp8_convert.quantize_act(dev.stream(), xs, m, k, &act)?;
            let g = Fp8BlockGemm {
                rows: m,
                out: n,
                inp: k,
                x: q.ptr(),
                x_scales: qs.ptr(),
                x_scale_ld: m,
                w: wq.ptr(),
                w_scales: ws.ptr(),
                y: y.ptr(),
                y_stride: n,
            };
            let t_gemm = time_ms(dev, 20, 7, |_| Ok(dev.blas_lt.fp8_block_gemm(dev.stream(), &g)?))?;
            let t_deq = time_ms(dev, 20, 7, |_| dequant.linear(dev, &Proj::fp8(lin8), xs, m, ys))?;
            let tflops = |t: f64| 2.0 * (m * n * k) as f64 / (t * 1e-3) / 1e12;
            let row = json!({
                "shape": name, "out": n, "in": k, "rows": m,
                "bf16_us": t_bf16 * 1e3, "bf16_tflops": tflops(t_bf16),
                "w8a8_us": t_w8a8 * 1e3, "w8a8_tflops": tflops(t_w8a8),
                "w8a8_gemm_only_us": t_gemm * 1e3, "w8a8_gemm_only_tflops": tflops(t_gemm),
                "dequant_bf16_us": t_deq * 1e3, "dequant_bf16_tflops": tflops(t_deq),
            });
            println!(
                "fp8 gemm {name:>14} [{n}, {k}] x {m:4}: bf16 {:8.1} us {:6.0} TF | w8a8 {:8.1} us {:6.0} TF (gemm {:8.1} us {:6.0} TF) | dequant+bf16 {:8.1} us",
                t_bf16 * 1e3,
                tflops(t_bf16),
                t_w8a8 * 1e3,
                tflops(t_w8a8),
                t_gemm * 1e3,
                tflops(t_gemm),
                t_deq * 1e3
            );
            rows_out.push(row);
        }
    }
    Ok(json!({ "cases": rows_out }))
}
