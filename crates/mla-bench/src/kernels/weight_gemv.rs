//! The weight-streaming GEMVs of small decode steps on DeepSeek-V3's dense shapes: the bf16
//! kernel against the block-FP8 ones (W8A16, issue 12: FMA, tensor-core MMA, and issue 29's
//! streaming kernel, at its chosen configuration and swept over its variants and K splits) on
//! the same shape, 1, 2, 4 and 8 rows (bf16 and FMA: up to 4), as time and bandwidth of weight
//! bytes, beside a device-to-device copy of 1 GiB measured in the same run (the yardstick).
//! Weights are rotated over enough copies to exceed the L2 cache, so every launch streams its
//! weight from HBM as a decode step does.

use super::timing::{fill, time_ms};
use cudarc::driver::sys;
use half::bf16;
use mla_core::SplitMix64;
use mla_cuda::gpu::DeviceBuffer;
use mla_cuda::ops::{
    Fp8GemvKind, Fp8Linear, GemvLaunch, GemvOut, Linear, StreamConfig, Strided, FP8_BLOCK, GEMV_KERNEL_MAX_ROWS,
    STREAM_VARIANTS,
};
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
/// The copy yardstick's buffer.
const COPY_BYTES: usize = 1 << 30;

/// TB/s of a device-to-device copy of `COPY_BYTES` (bytes read plus bytes written).
fn copy_tb_s(dev: &Device) -> anyhow::Result<f64> {
    let (a, b) = (DeviceBuffer::<u8>::alloc(COPY_BYTES)?, DeviceBuffer::<u8>::alloc(COPY_BYTES)?);
    let ms = time_ms(dev, 10, 7, |_| {
        // SAFETY: both buffers hold COPY_BYTES and live until the timing has synchronised.
        unsafe { sys::cuMemcpyDtoDAsync_v2(b.slice().ptr, a.slice().ptr, COPY_BYTES, dev.stream()) }
            .result()
            .map_err(|e| anyhow::anyhow!("device-to-device copy: {e:?}"))
    })?;
    Ok(2.0 * COPY_BYTES as f64 / (ms * 1e-3) / 1e12)
}

pub fn run(dev: &Device) -> anyhow::Result<Value> {
    let copy = copy_tb_s(dev)?;
    println!("device-to-device copy of 1 GiB: {copy:.2} TB/s (read + write)");
    let mut rows = vec![];
    let mut rng = SplitMix64::new(41);
    let has_stream = dev.k.gemv_fp8.has_stream();
    let floor = launch_floor_us(dev)?;
    println!("launch floor, [128, 256] x 1 back to back: mma {:.2} us, stream {:.2} us", floor.0, floor.1);
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
        for m in [1usize, 2, 4, 8] {
            let xs = Strided::new(x.slice(), k);
            let ys = || GemvOut::Bf16(Strided::new(y.slice(), n));
            let lin = |i: usize| Fp8Linear { w: fp8[i % copies].slice(), scale_inv: sd.slice(), out: n, inp: k };
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
            let fp8_time =
                |kind| time_ms(dev, 50, 7, |i| dev.k.gemv_fp8.launch_with(kind, dev.stream(), &lin(i), xs, m, ys()));
            let stream_time_n = |cfg, iters, reps| {
                time_ms(dev, iters, reps, |i| dev.k.gemv_fp8.launch_stream(cfg, dev.stream(), &lin(i), xs, m, ys()))
            };
            let stream_time = |cfg| stream_time_n(cfg, 50, 7);
            let t_fma = if small { fp8_time(Fp8GemvKind::Fma)? } else { f64::NAN };
            let t_mma = fp8_time(Fp8GemvKind::Mma)?;
            let (b16, b8) = ((n * k * 2) as f64, (n * k) as f64);
            let tb = |bytes: f64, ms: f64| bytes / (ms * 1e-3) / 1e12;
            let chosen = dev.k.gemv_fp8.stream_config(n, k, m);
            let (mut t_stream, mut t_stream_pf, mut sweep, mut best) = (f64::NAN, f64::NAN, vec![], None);
            if has_stream {
                t_stream = stream_time(chosen)?;
                t_stream_pf = stream_time(StreamConfig { prefetch: true, ..chosen })?;
                for (variant, v) in STREAM_VARIANTS.iter().enumerate() {
                    for splits in [1usize, 2, 3, 4, 6, 8] {
                        if StreamConfig::no_empty_split(k, splits) != splits {
                            continue;
                        }
                        let cfg = StreamConfig { variant, splits, prefetch: false };
                        let t = stream_time_n(cfg, 20, 5)?;
                        let vname = v.name();
                        sweep.push(json!({"variant": vname, "splits": splits, "us": t * 1e3, "tb_s": tb(b8, t)}));
                        if best.as_ref().is_none_or(|(bt, _, _)| t < *bt) {
                            best = Some((t, vname, splits));
                        }
                    }
                }
            }
            let (bt, bname, bsplits) = best.unwrap_or((f64::NAN, String::new(), 0));
            let row = json!({
                "shape": name, "out": n, "in": k, "rows": m,
                "bf16_us": t_bf16 * 1e3, "bf16_tb_s": tb(b16, t_bf16),
                "fp8_fma_us": t_fma * 1e3, "fp8_fma_tb_s": tb(b8, t_fma),
                "fp8_mma_us": t_mma * 1e3, "fp8_mma_tb_s": tb(b8, t_mma),
                "fp8_stream_config": format!("{} x{}{}", STREAM_VARIANTS[chosen.variant].name(), chosen.splits,
                    if chosen.prefetch { " +prefetch" } else { "" }),
                "fp8_stream_us": t_stream * 1e3, "fp8_stream_tb_s": tb(b8, t_stream),
                "fp8_stream_of_copy": tb(b8, t_stream) / copy,
                "fp8_stream_prefetch_us": t_stream_pf * 1e3,
                "fp8_stream_best": {"variant": bname, "splits": bsplits, "us": bt * 1e3, "tb_s": tb(b8, bt)},
                "fp8_stream_sweep": sweep,
            });
            println!(
                "weight gemv {name:>14} [{n}, {k}] x {m}: bf16 {:6.1} us | fp8 fma {:6.1} us {:4.2} TB/s | mma {:6.1} us {:4.2} TB/s | stream {:6.1} us {:4.2} TB/s ({:.0}% of copy; L2 prefetch {:.1}) | best {bname} x{bsplits} {:6.1} us {:4.2} TB/s",
                t_bf16 * 1e3,
                t_fma * 1e3,
                tb(b8, t_fma),
                t_mma * 1e3,
                tb(b8, t_mma),
                t_stream * 1e3,
                tb(b8, t_stream),
                100.0 * tb(b8, t_stream) / copy,
                t_stream_pf * 1e3,
                bt * 1e3,
                tb(b8, bt),
            );
            rows.push(row);
        }
    }
    Ok(json!({ "copy_tb_s": copy, "floor_us": {"mma": floor.0, "stream": floor.1}, "cases": rows }))
}

/// Time per launch of the MMA and streaming kernels on a tiny weight ([128, 256], 1 row): the
/// back-to-back launch cost that bounds the narrow shapes from below.
fn launch_floor_us(dev: &Device) -> anyhow::Result<(f64, f64)> {
    let (n, k) = (128, 256);
    let w = DeviceBuffer::from_host(&vec![0x38u8; n * k])?;
    let sd = DeviceBuffer::from_host(&[1f32; 2])?;
    let x = fill(dev, k, 1.0, 61)?;
    let y = DeviceBuffer::<bf16>::alloc(n)?;
    let lin = Fp8Linear { w: w.slice(), scale_inv: sd.slice(), out: n, inp: k };
    let (xs, ys) = (Strided::new(x.slice(), k), || GemvOut::Bf16(Strided::new(y.slice(), n)));
    let g = &dev.k.gemv_fp8;
    let mma = time_ms(dev, 50, 7, |_| g.launch_with(Fp8GemvKind::Mma, dev.stream(), &lin, xs, 1, ys()))?;
    let stream = if g.has_stream() {
        time_ms(dev, 50, 7, |_| g.launch_with(Fp8GemvKind::Stream, dev.stream(), &lin, xs, 1, ys()))?
    } else {
        f64::NAN
    };
    Ok((mma * 1e3, stream * 1e3))
}
