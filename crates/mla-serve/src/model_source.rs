//! Turning `--model` (and `--load-format`, `--tokenizer`) into the files to load: a local HF
//! directory, a preset config, a HF repo id in the local cache, or the bundled demo model.

use crate::cli::{Args, LoadFormat};
use crate::{demo, hf_cache, presets};
use anyhow::{bail, Context};
use mla_core::model::fp8_source::Fp8Quantized;
use mla_core::{Checkpoint, DummyWeights, ModelConfig, WeightSource};
use std::path::PathBuf;
use std::sync::Arc;

/// Everything resolved about the model before any weight is read.
pub struct ModelSource {
    /// Default served model name: the --model value, or "demo".
    pub name: String,
    /// Where the config came from, for the startup log.
    pub origin: String,
    pub config: ModelConfig,
    pub weights: WeightOrigin,
    /// Directory with tokenizer.json / tokenizer_config.json.
    pub tokenizer_dir: PathBuf,
    /// Directory whose generation_config.json supplies sampling defaults, if any.
    pub generation_config_dir: Option<PathBuf>,
    pub is_demo: bool,
    /// Said once at startup, e.g. that replies are nonsense.
    pub warnings: Vec<String>,
}

/// Where a model's weights are, as the flags name them.
pub enum WeightOrigin {
    Checkpoint(PathBuf),
    /// Deterministic random weights; the seed is fixed so a model gives the same replies on
    /// every start.
    Dummy {
        seed: u64,
    },
}

/// Seed of the demo and `--load-format dummy` weights.
pub const DUMMY_WEIGHT_SEED: u64 = 0;

impl ModelSource {
    /// The weights as the host reads them (the CPU backend, and the demo on the GPU). An FP8
    /// model's linear weights read as the exact dequantization of their FP8 values, quantized
    /// here when the checkpoint stores them in bf16 (`--quantization fp8`), as the CUDA loader
    /// quantizes them.
    pub fn host_weights(&self) -> anyhow::Result<Arc<dyn WeightSource + Send + Sync>> {
        let cfg = &self.config;
        let plain: Arc<dyn WeightSource + Send + Sync> = match &self.weights {
            WeightOrigin::Checkpoint(dir) => Arc::new(Checkpoint::open(dir, cfg)?),
            WeightOrigin::Dummy { seed } => Arc::new(DummyWeights::new(*seed)),
        };
        Ok(match cfg.quantization {
            Some(q) => Arc::new(Fp8Quantized::new(plain, q.block)),
            None => plain,
        })
    }

    /// Where the CUDA backend takes the weights from.
    pub fn cuda_weights(&self) -> mla_cuda::WeightsFrom {
        match &self.weights {
            WeightOrigin::Checkpoint(dir) => mla_cuda::WeightsFrom::Checkpoint(dir.clone()),
            // The demo draws the same host-side weights as on the CPU, so both give the same
            // replies; big dummy models are drawn on the device, which is much faster.
            WeightOrigin::Dummy { .. } if self.is_demo => {
                mla_cuda::WeightsFrom::Host(self.host_weights().expect("dummy weights open without I/O"))
            }
            WeightOrigin::Dummy { seed } => mla_cuda::WeightsFrom::DummyOnDevice { seed: *seed },
        }
    }
}

pub fn resolve(args: &Args) -> anyhow::Result<ModelSource> {
    let mut source = resolve_files(args)?;
    if let Some(method) = &args.quantization {
        // A bf16 model becomes a block-FP8 one: every backend reads its linear weights quantized
        // (see mla_core::model::fp8_source).
        let was_fp8 = source.config.quantization.is_some();
        source.config.apply_quantization_flag(method).map_err(anyhow::Error::msg)?;
        if !was_fp8 {
            source.origin.push_str(", linear weights quantized to block FP8 (--quantization fp8)");
        }
    }
    Ok(source)
}

fn resolve_files(args: &Args) -> anyhow::Result<ModelSource> {
    let Some(model) = args.model.as_deref() else {
        return demo_source(args);
    };
    let path = PathBuf::from(model);
    if path.is_dir() {
        return dir_source(model, path, args);
    }
    if let Some(text) = presets::find(model) {
        return preset_source(model, text, args);
    }
    if hf_cache::looks_like_repo_id(model) {
        return match hf_cache::find_snapshot(model, &hf_cache::hub_roots()) {
            Ok(dir) => dir_source(model, dir, args),
            Err(looked) => {
                let list: Vec<String> = looked.iter().map(|p| format!("  {}", p.display())).collect();
                bail!(
                    "--model {model}: not found in the local Hugging Face cache (nothing is downloaded). Looked in:\n{}\n\
                     Download it first (e.g. `huggingface-cli download {model}`), set HF_HOME, or pass a local directory.",
                    list.join("\n")
                )
            }
        };
    }
    bail!(
        "--model {model}: not a directory, not a preset ({}), and not a Hugging Face repo id of the form ORG/NAME",
        presets::names().join(", ")
    )
}

fn demo_source(args: &Args) -> anyhow::Result<ModelSource> {
    // The demo has no checkpoint: its weights are always dummy, so --load-format changes nothing
    // either way and both values are accepted.
    let dir = demo::materialize().context("unpacking the bundled demo model")?;
    let config = ModelConfig::from_file_with_overrides(&dir.join("config.json"), &args.hf_overrides()?)?;
    let tokenizer_dir = args.tokenizer.clone().unwrap_or_else(|| dir.clone());
    Ok(ModelSource {
        name: "demo".into(),
        origin: "the bundled demo model (tiny DeepSeek-V3 shape)".into(),
        config,
        weights: WeightOrigin::Dummy { seed: DUMMY_WEIGHT_SEED },
        tokenizer_dir,
        generation_config_dir: Some(dir),
        is_demo: true,
        warnings: vec![
            "serving the bundled demo model: its weights are random, so its replies are nonsense. Pass --model to serve a real checkpoint.".into(),
        ],
    })
}

fn dir_source(name: &str, dir: PathBuf, args: &Args) -> anyhow::Result<ModelSource> {
    let config = ModelConfig::from_file_with_overrides(&dir.join("config.json"), &args.hf_overrides()?)?;
    let weights = match args.load_format {
        LoadFormat::Auto => WeightOrigin::Checkpoint(dir.clone()),
        LoadFormat::Dummy => WeightOrigin::Dummy { seed: DUMMY_WEIGHT_SEED },
    };
    let tokenizer_dir = match &args.tokenizer {
        Some(t) => t.clone(),
        None if dir.join("tokenizer.json").is_file() => dir.clone(),
        None => bail!(
            "--model {name}: {} has no tokenizer.json; pass --tokenizer DIR with tokenizer.json and tokenizer_config.json",
            dir.display()
        ),
    };
    let mut warnings = vec![];
    if args.load_format == LoadFormat::Dummy {
        warnings.push("--load-format dummy: random weights, replies are nonsense (for benchmarks)".into());
    }
    Ok(ModelSource {
        name: name.to_string(),
        origin: dir.display().to_string(),
        config,
        weights,
        tokenizer_dir,
        generation_config_dir: Some(dir),
        is_demo: false,
        warnings,
    })
}

fn preset_source(name: &str, text: &str, args: &Args) -> anyhow::Result<ModelSource> {
    if args.load_format != LoadFormat::Dummy {
        bail!(
            "--model {name} is a preset: a config without weights. Add --load-format dummy to serve it with \
             random weights (benchmarks), or pass a checkpoint directory or HF repo id to --model"
        );
    }
    let config = ModelConfig::from_json_str_with_overrides(text, &format!("preset {name}"), &args.hf_overrides()?)?;
    let mut warnings = vec!["--load-format dummy: random weights, replies are nonsense (for benchmarks)".to_string()];
    let tokenizer_dir = match &args.tokenizer {
        Some(t) => t.clone(),
        None => {
            warnings.push(format!(
                "preset {name} has no tokenizer: using the demo tokenizer (512 tokens); generated ids outside it decode to nothing. Pass --tokenizer DIR for the real one"
            ));
            demo::materialize().context("unpacking the demo tokenizer")?
        }
    };
    Ok(ModelSource {
        name: name.to_string(),
        origin: format!("preset configs/{name}.json"),
        config,
        weights: WeightOrigin::Dummy { seed: DUMMY_WEIGHT_SEED },
        tokenizer_dir,
        generation_config_dir: None,
        is_demo: false,
        warnings,
    })
}
