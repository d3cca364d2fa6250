//! What the kernel benchmarks share: CUDA-event timing, random device inputs, and the comparison
//! of two kernel variants' outputs.

use half::bf16;
use mla_cuda::gpu::{DeviceBuffer, Event};
use mla_cuda::ops::Normal;
use mla_cuda::Device;

/// Median over `reps` repetitions of the time (ms) of one run of `f`, each repetition timing
/// `iters` back-to-back runs between two events. `f` gets a running index so that callers can
/// rotate inputs. Three untimed runs first, to load modules and warm the caches.
pub fn time_ms(
    dev: &Device,
    iters: usize,
    reps: usize,
    mut f: impl FnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    for i in 0..3 {
        f(i)?;
    }
    dev.gpu.sync()?;
    let mut times = Vec::with_capacity(reps);
    for r in 0..reps {
        let (start, stop) = (Event::new()?, Event::new()?);
        start.record(dev.stream())?;
        for i in 0..iters {
            f(r * iters + i)?;
        }
        stop.record(dev.stream())?;
        times.push(start.elapsed_ms(&stop)? as f64 / iters as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[reps / 2])
}

/// A device buffer of `n` bf16 values drawn from N(0, std²) on the device.
pub fn fill(dev: &Device, n: usize, std: f32, seed: u64) -> anyhow::Result<DeviceBuffer<bf16>> {
    let b = DeviceBuffer::<bf16>::alloc(n)?;
    dev.k.elementwise.fill_normal_bf16(dev.stream(), b.slice(), Normal { mean: 0.0, std, seed })?;
    Ok(b)
}

/// The relative L2 distance of `other` from `reference`, and whether `other` is all finite:
/// kernel variants that compute the same function must agree to bf16 rounding.
pub fn rel_diff(reference: &[f32], other: &[f32]) -> (f64, bool) {
    let num: f64 = reference.iter().zip(other).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = reference.iter().map(|a| (*a as f64).powi(2)).sum();
    ((num / den).sqrt(), other.iter().all(|x| x.is_finite()))
}

/// A device bf16 buffer on the host as f32.
pub fn download_f32(dev: &Device, b: &DeviceBuffer<bf16>) -> anyhow::Result<Vec<f32>> {
    dev.gpu.sync()?;
    Ok(b.download()?.iter().map(|x| x.to_f32()).collect())
}
