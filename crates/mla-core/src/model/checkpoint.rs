//! Memory-mapped access to a HF model directory: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Tensors are read by `TensorSpec`, so every read checks the
//! published name, the shape and the dtype, and errors name the tensor and the file.

use crate::model::config::{Fp8BlockQuant, ModelConfig};
use crate::model::fp8::{dequantize_block_fp8, scale_grid};
use crate::model::parallel::Shard as Part;
use crate::model::weight_source::{CheckpointError, Fp8Tensor, WeightSource};
use crate::model::weights::{ModelSpec, TensorSpec};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One memory-mapped safetensors file with its parsed header.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    meta: Metadata,
}

impl Shard {
    fn open(path: &Path) -> Result<Self, CheckpointError> {
        let io = |source| CheckpointError::Io { path: path.to_path_buf(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only; a checkpoint must not be rewritten while a server
        // has it open, as with every mmap-based loader.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&mmap)
            .map_err(|e| CheckpointError::BadSafetensors { path: path.to_path_buf(), message: e.to_string() })?;
        Ok(Shard { path: path.to_path_buf(), mmap, header_len, meta })
    }

    fn bytes(&self, info: &TensorInfo) -> &[u8] {
        let base = 8 + self.header_len;
        &self.mmap[base + info.data_offsets.0..base + info.data_offsets.1]
    }
}

/// An opened checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name -> shard index, from the index file or the single file's header.
    location: HashMap<String, usize>,
    /// Where a name would have been found, for "missing tensor" messages.
    lookup_source: String,
    quant: Option<Fp8BlockQuant>,
}

impl Checkpoint {
    /// Opens `dir` for `cfg`: maps every shard and logs (debug) the tensors the model does not
    /// use, such as the V3 multi-token-prediction layer.
    pub fn open(dir: &Path, cfg: &ModelConfig) -> Result<Self, CheckpointError> {
        let index_path = dir.join(INDEX_FILE);
        let single_path = dir.join(SINGLE_FILE);
        let ckpt = if index_path.is_file() {
            Self::open_sharded(dir, &index_path, cfg)?
        } else if single_path.is_file() {
            let shard = Shard::open(&single_path)?;
            let location = shard.meta.tensors().into_keys().map(|n| (n, 0)).collect();
            Checkpoint {
                dir: dir.to_path_buf(),
                lookup_source: single_path.display().to_string(),
                shards: vec![shard],
                location,
                quant: cfg.quantization,
            }
        } else {
            return Err(CheckpointError::NoWeightFiles { dir: dir.to_path_buf() });
        };
        ckpt.log_unused(&ModelSpec::new(cfg));
        Ok(ckpt)
    }

    fn open_sharded(dir: &Path, index_path: &Path, cfg: &ModelConfig) -> Result<Self, CheckpointError> {
        let bad = |message: String| CheckpointError::BadIndex { path: index_path.to_path_buf(), message };
        let text = std::fs::read_to_string(index_path)
            .map_err(|source| CheckpointError::Io { path: index_path.to_path_buf(), source })?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let map =
            json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("no `weight_map` object".into()))?;
        let mut shard_of_file: HashMap<String, usize> = HashMap::new();
        let mut shards = Vec::new();
        let mut location = HashMap::new();
        // Sorted so that the shard reported missing is the same on every run.
        let mut entries: Vec<_> = map.iter().collect();
        entries.sort_by(|a, b| a.0.cmp(b.0));
        for (tensor, file) in entries {
            let file = file.as_str().ok_or_else(|| bad(format!("entry `{tensor}` is not a file name")))?;
            let idx = match shard_of_file.get(file) {
                Some(&i) => i,
                None => {
                    let path = dir.join(file);
                    if !path.is_file() {
                        return Err(CheckpointError::MissingShard {
                            index: index_path.to_path_buf(),
                            shard: path,
                            tensor: tensor.clone(),
                        });
                    }
                    shards.push(Shard::open(&path)?);
                    shard_of_file.insert(file.to_string(), shards.len() - 1);
                    shards.len() - 1
                }
            };
            location.insert(tensor.clone(), idx);
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            location,
            lookup_source: index_path.display().to_string(),
            quant: cfg.quantization,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Names of all tensors the checkpoint lists.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.location.keys().map(|s| s.as_str())
    }

    fn log_unused(&self, spec: &ModelSpec) {
        let mut used: HashSet<String> = HashSet::new();
        for t in spec.tensors() {
            used.insert(t.name.clone());
            used.insert(t.scale_inv_name());
        }
        let mut extra: Vec<&str> = self.tensor_names().filter(|n| !used.contains(*n)).collect();
        extra.sort_unstable();
        for name in extra {
            tracing::debug!(tensor = name, "checkpoint tensor not used by the model; ignored");
        }
    }

    /// Finds a tensor by name: its shard and header entry.
    fn find(&self, name: &str) -> Result<(&Shard, &TensorInfo), CheckpointError> {
        let missing = |location: String| CheckpointError::MissingTensor { name: name.to_string(), location };
        let &idx = self.location.get(name).ok_or_else(|| missing(self.lookup_source.clone()))?;
        let shard = &self.shards[idx];
        let info = shard.meta.info(name).ok_or_else(|| missing(shard.path.display().to_string()))?;
        Ok((shard, info))
    }

    /// Finds `spec` and checks its shape.
    fn find_checked(&self, spec: &TensorSpec) -> Result<(&Shard, &TensorInfo), CheckpointError> {
        let (shard, info) = self.find(&spec.name)?;
        if info.shape != spec.shape {
            return Err(CheckpointError::WrongShape {
                name: spec.name.clone(),
                path: shard.path.clone(),
                expected: spec.shape.clone(),
                found: info.shape.clone(),
            });
        }
        Ok((shard, info))
    }

    fn wrong_dtype(spec: &TensorSpec, shard: &Shard, info: &TensorInfo) -> CheckpointError {
        let expected = if spec.fp8_quantizable() { "BF16, F16, F32 or F8_E4M3" } else { "BF16, F16 or F32" };
        CheckpointError::WrongDtype {
            name: spec.name.clone(),
            path: shard.path.clone(),
            expected: expected.into(),
            found: info.dtype.to_string(),
        }
    }

    /// Reads the FP8 bytes and the scale grid of a weight stored as F8_E4M3.
    fn fp8_parts(&self, spec: &TensorSpec, shard: &Shard, info: &TensorInfo) -> Result<Fp8Tensor, CheckpointError> {
        let quant = self.quant.ok_or_else(|| CheckpointError::Fp8WithoutQuantization {
            name: spec.name.clone(),
            path: shard.path.clone(),
        })?;
        let (rows, cols) = (spec.shape[0], spec.shape[1]);
        let grid = scale_grid(rows, cols, quant.block);
        let scale_spec = TensorSpec::new(spec.scale_inv_name(), grid.to_vec(), spec.role);
        let (s_shard, s_info) = self.find_checked(&scale_spec)?;
        let scale_inv =
            float_values(s_shard.bytes(s_info), s_info.dtype).ok_or_else(|| CheckpointError::WrongDtype {
                name: scale_spec.name.clone(),
                path: s_shard.path.clone(),
                expected: "F32, BF16 or F16".into(),
                found: s_info.dtype.to_string(),
            })?;
        Ok(Fp8Tensor { data: shard.bytes(info).to_vec(), rows, cols, scale_inv, block: quant.block })
    }
}

/// Converts little-endian BF16 / F16 / F32 bytes to f32; `None` for any other dtype.
fn float_values(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        _ => return None,
    })
}

impl WeightSource for Checkpoint {
    fn describe(&self) -> String {
        format!("checkpoint {}", self.dir.display())
    }

    fn read_f32(&self, spec: &TensorSpec) -> Result<Vec<f32>, CheckpointError> {
        let (shard, info) = self.find_checked(spec)?;
        if info.dtype == Dtype::F8_E4M3 && spec.fp8_quantizable() {
            let q = self.fp8_parts(spec, shard, info)?;
            return Ok(dequantize_block_fp8(&q.data, q.rows, q.cols, &q.scale_inv, q.block));
        }
        float_values(shard.bytes(info), info.dtype).ok_or_else(|| Self::wrong_dtype(spec, shard, info))
    }

    fn read_bf16_bits(&self, spec: &TensorSpec) -> Result<Vec<u16>, CheckpointError> {
        let (shard, info) = self.find_checked(spec)?;
        if info.dtype == Dtype::BF16 {
            return Ok(shard.bytes(info).chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect());
        }
        Ok(self.read_f32(spec)?.into_iter().map(|x| half::bf16::from_f32(x).to_bits()).collect())
    }

    /// Bf16 tensors are cut from the mapped file without reading the rest: a rank of a large
    /// tensor-parallel model copies only its own share.
    fn read_bf16_bits_shard(&self, spec: &TensorSpec, part: &Part) -> Result<Vec<u16>, CheckpointError> {
        let (shard, info) = self.find_checked(spec)?;
        if info.dtype != Dtype::BF16 || *part == Part::Whole {
            return match part {
                Part::Whole => self.read_bf16_bits(spec),
                _ => Ok(part.take(&self.read_bf16_bits(spec)?, &spec.shape)),
            };
        }
        let bytes = shard.bytes(info);
        let words = |b: &[u8]| b.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect::<Vec<u16>>();
        let row: usize = spec.shape[1..].iter().product();
        Ok(match part {
            Part::Whole => unreachable!("handled above"),
            Part::Rows(r) => words(&bytes[2 * r.start * row..2 * r.end * row]),
            Part::Cols(c) => {
                (0..spec.shape[0]).flat_map(|i| words(&bytes[2 * (i * row + c.start)..2 * (i * row + c.end)])).collect()
            }
        })
    }

    fn read_fp8(&self, spec: &TensorSpec) -> Result<Option<Fp8Tensor>, CheckpointError> {
        let (shard, info) = self.find_checked(spec)?;
        if info.dtype != Dtype::F8_E4M3 {
            return Ok(None);
        }
        if !spec.fp8_quantizable() {
            return Err(Self::wrong_dtype(spec, shard, info));
        }
        self.fp8_parts(spec, shard, info).map(Some)
    }
}
