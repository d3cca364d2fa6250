//! Command-line flags, named as vLLM and SGLang users know them.
//!
//! Every flag is used. A flag whose feature does not exist for the chosen device (or at all yet)
//! is refused by `check_supported` with a message saying so, never accepted and ignored.

use clap::{Parser, ValueEnum};
use std::path::PathBuf;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "mla-serve",
    version,
    about = "OpenAI-compatible inference server for DeepSeek-V2 / V2-Lite / V3 (MLA + DeepSeekMoE)",
    long_about = "OpenAI-compatible inference server for DeepSeek-V2 / V2-Lite / V3 (MLA + DeepSeekMoE).\n\n\
        Without --model it serves a tiny bundled demo model on the CPU (random weights: the replies \
        are nonsense, but every endpoint works).\n\n\
        Examples:\n  mla-serve\n  mla-serve --model /models/DeepSeek-V2-Lite-Chat --port 8000\n  \
        mla-serve --model deepseek-ai/DeepSeek-V2-Lite-Chat --api-key secret\n  \
        mla-serve --model deepseek-v2-lite --load-format dummy"
)]
pub struct Args {
    /// Model to serve: a local HF model directory, a preset name from configs/ (config only: use
    /// with --load-format dummy), or a HF repo id (ORG/NAME) already in the local HF cache.
    /// Default: the bundled demo model.
    #[arg(long, value_name = "DIR|PRESET|ORG/NAME")]
    pub model: Option<String>,

    /// Directory with tokenizer.json and tokenizer_config.json, when the model has none (presets).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,

    /// Model name clients send and /v1/models lists. Default: the --model value.
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,

    /// Address to listen on (0.0.0.0 for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    #[arg(long, default_value_t = 8000)]
    pub port: u16,

    /// Compute device. cuda needs a model with the published MLA dims (kv_lora_rank 512, rope 64,
    /// nope 128, v 128) and a binary built with nvcc; auto picks cuda when all that holds and a
    /// GPU is visible, else cpu (the startup log says why).
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,

    /// Tensor-parallel GPUs. Only 1 is implemented so far.
    #[arg(long = "tp", visible_alias = "tensor-parallel-size", default_value_t = 1, value_name = "N")]
    pub tp: usize,

    /// Data-parallel attention across the --tp GPUs (not implemented yet).
    #[arg(long)]
    pub enable_dp_attention: bool,

    /// Longest sequence (prompt + completion) in tokens. Default: the model's
    /// max_position_embeddings, capped by the KV cache size.
    #[arg(long, value_name = "TOKENS")]
    pub max_model_len: Option<usize>,

    /// Most sequences decoded together in one batch.
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub max_num_seqs: usize,

    /// Token budget of one prefill step; longer prompts are prefilled in chunks of this size.
    #[arg(long, default_value_t = 2048, value_name = "TOKENS")]
    pub max_num_batched_tokens: usize,

    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 64, value_name = "TOKENS")]
    pub block_size: usize,

    /// Fraction of GPU memory to use for weights, activations and KV cache (--device cuda only;
    /// default 0.9).
    #[arg(long, value_name = "FRACTION")]
    pub gpu_memory_utilization: Option<f64>,

    /// KV cache size in tokens. Default on cpu: what fits in 1 GiB, at most 32 contexts; on cuda:
    /// what --gpu-memory-utilization leaves free.
    #[arg(long, value_name = "TOKENS")]
    pub kv_cache_tokens: Option<usize>,

    /// auto: read the checkpoint's safetensors; dummy: deterministic random weights of the
    /// configured shape (benchmarks, presets).
    #[arg(long, value_enum, default_value_t = LoadFormat::Auto)]
    pub load_format: LoadFormat,

    /// Jinja chat template file replacing the tokenizer_config.json template.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,

    /// Require `Authorization: Bearer <KEY>` on every /v1 request.
    #[arg(long, env = "MLA_SERVE_API_KEY", hide_env_values = true, value_name = "KEY")]
    pub api_key: Option<String>,

    /// Requests allowed to wait for a batch slot; more are answered 503.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub max_queued_requests: usize,

    /// Seed for requests that bring none (same seed, same server: same outputs).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Log verbosity.
    #[arg(long, value_enum, default_value_t = LogLevel::Info)]
    pub log_level: LogLevel,

    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub shutdown_timeout: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Auto,
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LoadFormat {
    Auto,
    Dummy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    pub fn as_str(&self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

impl Args {
    /// Resolves `--device auto` and refuses flags the chosen device cannot honour.
    pub fn check_supported(&self) -> anyhow::Result<Device> {
        if self.tp != 1 {
            anyhow::bail!(
                "--tp {}: multi-GPU tensor parallelism is not implemented yet; only --tp 1 works today",
                self.tp
            );
        }
        if self.enable_dp_attention {
            anyhow::bail!("--enable-dp-attention: multi-GPU data-parallel attention is not implemented yet");
        }
        // auto is resolved once the model is known (backends::resolve_device): it needs the
        // model's dims and a probe for a GPU.
        let device = self.device;
        match (device, self.gpu_memory_utilization) {
            (Device::Cpu, Some(u)) => anyhow::bail!(
                "--gpu-memory-utilization {u}: applies to --device cuda only; size the CPU KV cache with --kv-cache-tokens"
            ),
            (_, Some(u)) if !(u > 0.0 && u <= 1.0) => {
                anyhow::bail!("--gpu-memory-utilization must be in (0, 1], got {u}")
            }
            _ => {}
        }
        if !(self.shutdown_timeout.is_finite() && self.shutdown_timeout >= 0.0) {
            anyhow::bail!("--shutdown-timeout must be a non-negative number of seconds, got {}", self.shutdown_timeout);
        }
        for (flag, v) in [
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--block-size", self.block_size),
            ("--max-queued-requests", self.max_queued_requests),
        ] {
            if v == 0 {
                anyhow::bail!("{flag} must be at least 1");
            }
        }
        if self.max_model_len == Some(0) || self.kv_cache_tokens == Some(0) {
            anyhow::bail!("--max-model-len and --kv-cache-tokens must be at least 1");
        }
        Ok(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("mla-serve").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn defaults_match_the_documented_ones() {
        let a = parse(&[]);
        assert_eq!((a.port, a.block_size, a.tp), (8000, 64, 1));
        assert_eq!(a.check_supported().unwrap(), Device::Auto);
    }

    #[test]
    fn unimplemented_features_fail_with_a_reason() {
        for (args, needle) in [
            (&["--tp", "8"][..], "not implemented"),
            (&["--enable-dp-attention"][..], "not implemented"),
            (&["--device", "cpu", "--gpu-memory-utilization", "0.9"][..], "cuda only"),
            (&["--device", "cuda", "--gpu-memory-utilization", "1.5"][..], "(0, 1]"),
            (&["--block-size", "0"][..], "--block-size"),
        ] {
            let err = parse(args).check_supported().unwrap_err().to_string();
            assert!(err.contains(needle), "{args:?}: {err}");
        }
        assert!(Args::try_parse_from(["mla-serve", "--device", "tpu"]).is_err());
        assert!(Args::try_parse_from(["mla-serve", "--no-such-flag"]).is_err());
    }
}
