//! Helpers shared by the GPU tests: random data, bf16 rounding, device uploads, error metrics,
//! and where the repository's fixtures are when the test binary runs on another machine.
#![allow(dead_code)]

use half::bf16;
use mla_core::SplitMix64;
use mla_cuda::gpu::{DSlice, DeviceBuffer};
use mla_cuda::Device;
use std::path::PathBuf;

pub fn device() -> Device {
    Device::new(0).expect("these tests need an NVIDIA GPU with libcuda and cuBLAS on the library path")
}

pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(SplitMix64::new(seed))
    }
    /// Uniform in [-a, a).
    pub fn uniform(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| ((self.0.next_f64() * 2.0 - 1.0) * a as f64) as f32).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.0.next_u64() % n as u64) as usize
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// Rounds through bf16, so host references see exactly what the device holds.
pub fn round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

pub fn up_bf16(v: &[f32]) -> DeviceBuffer<bf16> {
    DeviceBuffer::from_host(&to_bf16(v)).unwrap()
}

pub fn up<T: Copy>(v: &[T]) -> DeviceBuffer<T> {
    DeviceBuffer::from_host(v).unwrap()
}

pub fn down_bf16(s: DSlice<bf16>) -> Vec<f32> {
    mla_cuda::gpu::download_slice(s).unwrap().iter().map(|x| x.to_f32()).collect()
}

pub fn down<T: Copy + Default>(s: DSlice<T>) -> Vec<T> {
    mla_cuda::gpu::download_slice(s).unwrap()
}

/// ‖a − b‖ / ‖b‖; NaN anywhere fails.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared vectors differ in length");
    assert!(a.iter().all(|x| x.is_finite()), "device output holds NaN or inf");
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Repository root: `MLA_REPO_ROOT`, else the checkout this binary was built in, else the
/// current directory (the device machine runs tests from its copy of the repository root).
pub fn repo_root() -> PathBuf {
    if let Ok(p) = std::env::var("MLA_REPO_ROOT") {
        return PathBuf::from(p);
    }
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    if built.join("tests/fixtures").is_dir() {
        return built;
    }
    std::env::current_dir().unwrap()
}

pub fn config(name: &str) -> mla_core::ModelConfig {
    mla_core::ModelConfig::from_file(&repo_root().join("configs").join(name)).unwrap()
}

/// Distinct random physical blocks for `n` sequences needing `blocks[i]` blocks each.
pub fn scattered_tables(rng: &mut Rng, blocks: &[usize], total: usize) -> Vec<Vec<u32>> {
    let mut ids: Vec<u32> = (0..total as u32).collect();
    rng.shuffle(&mut ids);
    let mut at = 0;
    blocks
        .iter()
        .map(|&b| {
            let t = ids[at..at + b].to_vec();
            at += b;
            t
        })
        .collect()
}
