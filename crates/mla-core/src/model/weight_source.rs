//! Where weights come from: a checkpoint on disk or deterministic dummy weights. Backends build
//! themselves from a `WeightSource` and a `ModelSpec` and never care which one it is.

use crate::model::parallel::Shard;
use crate::model::weights::TensorSpec;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Why a tensor could not be read, from a checkpoint directory or any other `WeightSource`.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{dir}: no model.safetensors and no model.safetensors.index.json")]
    NoWeightFiles { dir: PathBuf },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a valid safetensors index: {message}")]
    BadIndex { path: PathBuf, message: String },
    #[error("{index}: maps tensor `{tensor}` to shard {shard}, which does not exist")]
    MissingShard { index: PathBuf, shard: PathBuf, tensor: String },
    #[error("{path}: not a valid safetensors file: {message}")]
    BadSafetensors { path: PathBuf, message: String },
    #[error("tensor `{name}` is missing from {location}")]
    MissingTensor { name: String, location: String },
    #[error("tensor `{name}` in {path}: shape {found:?}, expected {expected:?}")]
    WrongShape { name: String, path: PathBuf, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor `{name}` in {path}: dtype {found}, expected {expected}")]
    WrongDtype { name: String, path: PathBuf, expected: String, found: String },
    #[error("tensor `{name}` in {path} is F8_E4M3 but config.json has no quantization_config with weight_block_size")]
    Fp8WithoutQuantization { name: String, path: PathBuf },
    #[error("tensor `{name}`: this rank's share cannot be cut from the FP8 tensor: {message}")]
    Fp8Shard { name: String, message: String },
}

/// A block-FP8 weight as stored: E4M3 bytes `[rows, cols]` and fp32 scales over `block` tiles.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Tensor {
    pub data: Vec<u8>,
    pub rows: usize,
    pub cols: usize,
    /// `[ceil(rows / block[0]), ceil(cols / block[1])]`, row-major.
    pub scale_inv: Vec<f32>,
    pub block: [usize; 2],
}

/// Read access to the tensors of one model. Every read checks the stored shape against the spec.
pub trait WeightSource: Sync {
    /// Short description for logs, e.g. the checkpoint directory or "dummy (seed 0)".
    fn describe(&self) -> String;

    /// The tensor in f32, converted from BF16 / F16 / F32 and dequantized from block FP8.
    fn read_f32(&self, spec: &TensorSpec) -> Result<Vec<f32>, CheckpointError>;

    /// The part `shard` of the tensor in f32 (one rank's share under tensor parallelism). By
    /// default the whole tensor is read and cut; a source may read only the part.
    fn read_f32_shard(&self, spec: &TensorSpec, shard: &Shard) -> Result<Vec<f32>, CheckpointError> {
        match shard {
            Shard::Whole => self.read_f32(spec),
            _ => Ok(shard.take(&self.read_f32(spec)?, &spec.shape)),
        }
    }

    /// The tensor as bf16 bits: copied when stored as BF16, rounded to nearest-even otherwise.
    fn read_bf16_bits(&self, spec: &TensorSpec) -> Result<Vec<u16>, CheckpointError> {
        Ok(self.read_f32(spec)?.into_iter().map(|x| half::bf16::from_f32(x).to_bits()).collect())
    }

    /// The stored FP8 bytes and scales when the tensor is block-FP8 in this source, else `None`
    /// (for backends that compute in FP8 instead of dequantizing).
    fn read_fp8(&self, spec: &TensorSpec) -> Result<Option<Fp8Tensor>, CheckpointError>;

    /// The part `shard` of a block-FP8 tensor, with the scales of its blocks (`None` as for
    /// `read_fp8`). Cuts must fall on scale blocks; tensor parallelism over V3's dims does.
    fn read_fp8_shard(&self, spec: &TensorSpec, shard: &Shard) -> Result<Option<Fp8Tensor>, CheckpointError> {
        let Some(t) = self.read_fp8(spec)? else { return Ok(None) };
        t.shard(shard).map(Some).map_err(|message| CheckpointError::Fp8Shard { name: spec.name.clone(), message })
    }

    /// The part `shard` of the tensor as bf16 bits (see `read_f32_shard`).
    fn read_bf16_bits_shard(&self, spec: &TensorSpec, shard: &Shard) -> Result<Vec<u16>, CheckpointError> {
        match shard {
            Shard::Whole => self.read_bf16_bits(spec),
            _ => Ok(shard.take(&self.read_bf16_bits(spec)?, &spec.shape)),
        }
    }
}

/// Progress of loading `total` tensors: a bar (indicatif) when stderr is a terminal, else a log
/// line at every tenth of the way, so a long load shows progress in Kubernetes logs and files.
pub enum LoadProgress {
    Bar(indicatif::ProgressBar),
    Lines { what: String, total: usize, done: AtomicUsize, started: Instant },
}

impl LoadProgress {
    pub fn new(total: usize, what: &str) -> Self {
        if !std::io::stderr().is_terminal() {
            return LoadProgress::Lines {
                what: what.to_string(),
                total,
                done: AtomicUsize::new(0),
                started: Instant::now(),
            };
        }
        let bar = indicatif::ProgressBar::new(total as u64);
        if let Ok(style) = indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} tensors ({elapsed})") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(what.to_string());
        LoadProgress::Bar(bar)
    }

    /// One more tensor loaded (from any loading thread).
    pub fn inc(&self) {
        match self {
            LoadProgress::Bar(bar) => bar.inc(1),
            LoadProgress::Lines { what, total, done, started } => {
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(tenth) = tenth_reached(n, *total) {
                    let secs = started.elapsed().as_secs_f64();
                    tracing::info!("{what}: {}0% ({n}/{total} tensors, {secs:.1} s)", tenth);
                }
            }
        }
    }

    /// Removes the bar once loading is done.
    pub fn finish(&self) {
        if let LoadProgress::Bar(bar) = self {
            bar.finish_and_clear();
        }
    }
}

/// `Some(k)` when the `n`-th of `total` tensors is the first at or past k tenths of them.
fn tenth_reached(n: usize, total: usize) -> Option<usize> {
    let tenths = |m: usize| (m * 10).checked_div(total).unwrap_or(10);
    (n > 0 && tenths(n) > tenths(n - 1)).then(|| tenths(n))
}

#[cfg(test)]
mod progress_tests {
    #[test]
    fn ten_lines_per_load_whatever_the_count() {
        for total in [1, 7, 10, 1234] {
            let lines: Vec<usize> = (1..=total).filter_map(|n| super::tenth_reached(n, total)).collect();
            assert_eq!(*lines.last().unwrap(), 10, "{total}");
            assert!(lines.len() <= 10 && lines.windows(2).all(|w| w[0] < w[1]), "{total}: {lines:?}");
        }
    }
}
