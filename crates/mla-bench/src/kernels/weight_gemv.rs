//! The weight-streaming GEMVs of small decode steps on DeepSeek-V3's dense shapes: the bf16
//! kernel against the block-FP8 ones (W8A16, issue 12: FMA and tensor-core MMA) on the same
//! shape, 1, 4 and 8 rows (8: the MMA kernel only), as time and bandwidth of weight bytes. Weights are rotated over enough copies to exceed the L2 cache,
//! so every launch streams its weight from HBM as a decode step does.

use super::timing::{fill, time_ms};
use half::bf16;
use mla_core::SplitMix64;
use mla_cuda::gpu::DeviceBuffer;
use mla_cuda::ops::{Fp8GemvKind, Fp8Linear, GemvLaunch, GemvOut, Linear, Strided, FP8_BLOCK, GEMV_KERNEL_MAX_ROWS};
use mla_cuda::Device;
use serde_json::{json, Value};

/// (name, out, in): V3's fused q_a + kv_a projection, q_b, o_proj, a dense layer's down
/// projection, and its gate/up.
const SHAPES: [(&str, usize, usize); 5] = [
    ("q_a+kv_a", 2112, 7168),
    ("q_b", 24576, 1536),
    ("o_proj", 7168, 16384),
    ("dense_down", 7168, 18432),
    ("dense_gate_up", 36864, 7168),
];
/// Bytes the rotated weight copies of one shape span at least (H100 and H200 L2: 50 MB).
const ROTATE_BYTES: usize = 256 << 20;

pub fn run(dev: &Device) -> anyhow::Result<Value> {
    let mut rows = vec![];
    let mut rng = SplitMix64::new(41);
    for (name, n, k) in SHAPES {
        let copies = ROTATE_BYTES.div_ceil(n * k).clamp(1, 16);
        let bf: Vec<DeviceBuffer<bf16>> =
            (0..copies).map(|c| fill(dev, n * k, 0.02, 50 + c as u64)).collect::<anyhow::Result<_>>()?;
        let scales = vec![1e-3f32; n.div_ceil(FP8_BLOCK) * k.div_ceil(FP8_BLOCK)];
        let sd = DeviceBuffer::from_host(&scales)?;
        let mut fp8 = Vec::with_capacity(copies);
        for _ in 0..copies {
            // Random e4m3 codes other than NaN (0x7f, 0xff).
            let bytes: Vec<u8> = (0..n * k).map(|_| (rng.next_u64() % 255) as u8 & 0xfe).collect();
            fp8.push(DeviceBuffer::from_host(&bytes)?);
        }
        let x = fill(dev, 8 * k, 1.0, 60)?;
        let y = DeviceBuffer::<bf16>::alloc(8 * n)?;
        for m in [1usize, 4, 8] {
            let xs = Strided::new(x.slice(), k);
            let ys = || GemvOut::Bf16(Strided::new(y.slice(), n));
            // The bf16 and FMA kernels take at most GEMV_KERNEL_MAX_ROWS rows (NaN past them).
            let small = m <= GEMV_KERNEL_MAX_ROWS;
            let t_bf16 = if small {
                time_ms(dev, 50, 7, |i| {
                    let lin = Linear::new(bf[i % copies].slice(), n, k);
                    dev.k.gemv.launch(dev.stream(), &GemvLaunch { lin: &lin, x: xs, rows: m, y: ys(), second: None })
                })?
            } else {
                f64::NAN
            };
            let fp8_time = |kind| {
                time_ms(dev, 50, 7, |i| {
                    let lin = Fp8Linear { w: fp8[i % copies].slice(), scale_inv: sd.slice(), out: n, inp: k };
                    dev.k.gemv_fp8.launch_with(kind, dev.stream(), &lin, xs, m, ys())
                })
            };
            let t_fma = if small { fp8_time(Fp8GemvKind::Fma)? } else { f64::NAN };
            let t_mma = fp8_time(Fp8GemvKind::Mma)?;
            let (b16, b8) = ((n * k * 2) as f64, (n * k) as f64);
            let tb = |bytes: f64, ms: f64| bytes / (ms * 1e-3) / 1e12;
            let row = json!({
                "shape": name, "out": n, "in": k, "rows": m,
                "bf16_us": t_bf16 * 1e3, "bf16_tb_s": tb(b16, t_bf16),
                "fp8_fma_us": t_fma * 1e3, "fp8_fma_tb_s": tb(b8, t_fma),
                "fp8_mma_us": t_mma * 1e3, "fp8_mma_tb_s": tb(b8, t_mma),
            });
            println!(
                "weight gemv {name:>14} [{n}, {k}] x {m}: bf16 {:7.1} us {:4.2} TB/s | fp8 fma {:7.1} us {:4.2} TB/s | fp8 mma {:7.1} us {:4.2} TB/s",
                t_bf16 * 1e3,
                tb(b16, t_bf16),
                t_fma * 1e3,
                tb(b8, t_fma),
                t_mma * 1e3,
                tb(b8, t_mma),
            );
            rows.push(row);
        }
    }
    Ok(json!({ "cases": rows }))
}
