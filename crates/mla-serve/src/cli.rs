//! Command-line flags, named as vLLM and SGLang users know them.
//!
//! Every flag is used. A flag whose feature does not exist for the chosen device (or at all yet)
//! is refused by `check_supported` with a message saying so, never accepted and ignored.

use crate::access_log_args::AccessLogArgs;
use crate::compat_args::CompatArgs;
use crate::cors_args::CorsArgs;
use crate::http_limits::HttpLimitArgs;
use crate::routing_args::RoutingArgs;
use crate::speculative_args::SpeculativeArgs;
use clap::{Parser, ValueEnum};
use mla_core::step::limits::DEFAULT_EXTRA_LOGIT_ROWS;
use mla_core::{KvCacheDtype, Parallel, StepBudget, StepLimits};
use mla_server::parsers::{ParserConfig, ReasoningParserKind, ToolParserKind};
use std::ffi::OsString;
use std::path::PathBuf;

/// `--max-num-batched-tokens` when not given.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 2048;

#[derive(Debug, Clone, Parser)]
// A flag given twice takes its last value, as in vLLM's argparse command lines (scripts that
// append flags to a default list repeat them).
#[command(
    args_override_self = true,
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

    /// The model as vLLM takes it: `mla-serve [serve] MODEL [FLAGS]`, the same as --model.
    #[arg(value_name = "MODEL")]
    pub model_positional: Option<String>,

    /// Directory with tokenizer.json and tokenizer_config.json, when the model has none (presets).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,

    /// Model names clients may send, all listed by /v1/models; responses and metrics use the
    /// first. Default: the --model value.
    #[arg(long, num_args = 1.., value_name = "NAME")]
    pub served_model_name: Vec<String>,

    /// Compute precision: auto (bfloat16 on cuda, float32 on cpu, the only ones each backend
    /// has); naming the other one is an error rather than a silent substitution.
    #[arg(long, value_enum, default_value_t = Dtype::Auto)]
    pub dtype: Dtype,

    /// Accepted for vLLM command lines: DeepSeek-V2/V3 need no remote code, nothing is run.
    #[arg(long)]
    pub trust_remote_code: bool,

    /// vLLM's weight quantization: `fp8` keeps the linear weights in block-FP8 (e4m3 with one f32
    /// scale per 128x128 block, DeepSeek-V3's format), quantizing a bf16 checkpoint's on load:
    /// half the weight bytes. FP8 checkpoints (V3, R1) are kept in FP8 with or without the flag.
    /// Other methods are refused.
    #[arg(long, value_name = "METHOD")]
    pub quantization: Option<String>,

    /// vLLM's KV cache dtype: `auto` (the compute dtype) or `fp8` / `fp8_e4m3`: the latent cache
    /// in E4M3 with a power-of-two scale per 64 columns, 592 bytes per token and layer against
    /// 1,152 (1.95x the tokens), read directly by the decode kernel (`fp8_e5m2` is refused).
    #[arg(long, value_name = "DTYPE", default_value = "auto")]
    pub kv_cache_dtype: String,

    /// Address to listen on (0.0.0.0 for every interface). MLA_SERVE_HOST sets the default, so
    /// the Docker image listens on every interface and `docker run IMAGE --host X` still wins.
    #[arg(long, env = "MLA_SERVE_HOST", default_value = "127.0.0.1")]
    pub host: String,

    #[arg(long, default_value_t = 8000)]
    pub port: u16,

    /// Compute device. cuda needs a model with the published MLA dims (kv_lora_rank 512, rope 64,
    /// nope 128, v 128) and a binary built with nvcc; auto picks cuda when all that holds and a
    /// GPU is visible, else cpu (the startup log says why).
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,

    /// Tensor parallelism: N GPUs hold one copy of the model, each with 1/N of the attention
    /// heads and of every FFN width, and all-reduce after attention and FFN. Also -tp.
    #[arg(long = "tp", visible_aliases = ["tensor-parallel-size", "tp-size"], default_value_t = 1, value_name = "N")]
    pub tp: usize,

    /// Data parallelism: N independent copies of the model (each --tp GPUs), each with its own
    /// scheduler and KV cache, behind one router. With --enable-dp-attention it must equal --tp
    /// (its default there). Also -dp.
    #[arg(long = "dp", visible_aliases = ["data-parallel-size", "dp-size"], value_name = "N")]
    pub dp: Option<usize>,

    /// Attention data parallelism over the --tp GPUs (SGLang's meaning): each GPU runs attention
    /// for its own requests with its own KV cache; the MoE and MLP are sharded over all of them.
    #[arg(long)]
    pub enable_dp_attention: bool,

    /// Nodes the --tp ranks span (SGLang's name); node 0 serves HTTP.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub nnodes: usize,

    /// This node's index in 0..--nnodes.
    #[arg(long, default_value_t = 0, value_name = "I")]
    pub node_rank: usize,

    /// Where node 0 listens for the other nodes (the rendezvous and the per-step agreement);
    /// required with --nnodes above 1.
    #[arg(long, value_name = "HOST:PORT")]
    pub dist_init_addr: Option<String>,

    /// Seconds the nodes of --nnodes wait for each other at start (node 0 for the others to
    /// join, the others for node 0 to be reachable) before giving up with an error.
    #[arg(long, default_value_t = 300.0, value_name = "SECONDS")]
    pub dist_timeout: f64,

    /// Seconds a step may take before the engine is declared dead instead of hanging (a hung
    /// device, a rank stuck in a collective): its requests get the error, /health turns 503 and
    /// the server exits non-zero. SGLang's name and default.
    #[arg(long, default_value_t = 300.0, value_name = "SECONDS")]
    pub watchdog_timeout: f64,

    /// Longest sequence (prompt + completion) in tokens. Default: the model's
    /// max_position_embeddings, capped by the KV cache size.
    #[arg(long, value_name = "TOKENS")]
    pub max_model_len: Option<usize>,

    /// Most sequences decoded together in one batch.
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub max_num_seqs: usize,

    /// Token budget of one step of one attention rank; longer prompts are prefilled in chunks
    /// of this size (default 2048). Under DP attention every rank has it, and the FFN runs over
    /// the ranks' steps together. Left at its default on a GPU, it is lowered when it would
    /// leave the KV cache less than --max-model-len (or 16384 tokens), and the log says so.
    #[arg(long, value_name = "TOKENS")]
    pub max_num_batched_tokens: Option<usize>,

    /// Most prompt tokens one request feeds in a step (vLLM's flag; 0, the default: as many as
    /// --max-num-batched-tokens leaves). A long prompt then leaves the rest of every step to the
    /// prompts behind it, which reach their first token without waiting for it to finish; the
    /// long prompt itself takes more steps.
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    pub long_prefill_token_threshold: usize,

    /// JSON object merged into the model's config.json before it is validated (vLLM's flag; a
    /// JSON merge patch: objects merge, null removes), e.g. '{"num_hidden_layers": 6}' to run a
    /// V3-shaped model with dummy weights on one GPU. Overriding a field mla-serve does not read
    /// is an error.
    #[arg(long, value_name = "JSON")]
    pub hf_overrides: Option<String>,

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

    /// Jinja chat template replacing the tokenizer_config.json one: a file, or the template
    /// itself (as vLLM takes it) when no such file exists and it contains `{{` or `{%`.
    #[arg(long, value_name = "FILE|TEMPLATE")]
    pub chat_template: Option<String>,

    /// Splits chat replies into `reasoning_content` and `content` at the end of the model's
    /// thinking block (vLLM's flag). Known: deepseek_r1 (also spelled deepseek-r1).
    #[arg(long, value_name = "NAME", value_parser = parse_reasoning_parser)]
    pub reasoning_parser: Option<ReasoningParserKind>,

    /// Reads tool calls out of chat replies in this format (vLLM's flag; needs
    /// --enable-auto-tool-choice). Known: deepseek_v3 (V3, R1), deepseek_v31 (V3.1).
    #[arg(long, value_name = "NAME", value_parser = parse_tool_call_parser)]
    pub tool_call_parser: Option<ToolParserKind>,

    /// Lets requests use `tool_choice: "auto"` (the default when they send tools): the model
    /// decides whether to call tools, parsed with --tool-call-parser (vLLM's flag).
    #[arg(long)]
    pub enable_auto_tool_choice: bool,

    /// Require `Authorization: Bearer <KEY>` on every /v1 request (also read from vLLM's
    /// VLLM_API_KEY when neither this flag nor MLA_SERVE_API_KEY is set).
    #[arg(long, env = "MLA_SERVE_API_KEY", hide_env_values = true, value_name = "KEY")]
    pub api_key: Option<String>,

    #[command(flatten)]
    pub http: HttpLimitArgs,

    #[command(flatten)]
    pub cors: CorsArgs,

    /// Requests allowed to wait for a batch slot; more are answered 503.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub max_queued_requests: usize,

    /// Automatic prefix caching, on by default: computed KV cache blocks are kept by content
    /// after their requests end and reused by later prompts that start with the same tokens.
    /// vLLM's flag; accepted for scripts that pass it.
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,

    /// Turns automatic prefix caching off (also SGLang's --disable-radix-cache).
    #[arg(long, alias = "disable-radix-cache", overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,

    /// Mixed steps, on by default: every step feeds each running sequence its next token and
    /// fills the rest of --max-num-batched-tokens with prompt chunks (as vLLM's scheduler
    /// always does), so decoding never pauses for a prompt. SGLang's flag; accepted for scripts
    /// that pass it.
    #[arg(long, overrides_with = "no_enable_mixed_chunk")]
    pub enable_mixed_chunk: bool,

    /// Prefill and decode steps take turns instead of mixing (also --disable-mixed-chunk).
    #[arg(long, alias = "disable-mixed-chunk", overrides_with = "enable_mixed_chunk")]
    pub no_enable_mixed_chunk: bool,

    #[command(flatten)]
    pub routing: RoutingArgs,

    /// Seed for requests that bring none (same seed, same server: same outputs).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Turns off the periodic line (every 5 s while busy) with throughput, running and waiting
    /// requests, KV cache usage and the prefix cache hit rate. vLLM's flag.
    #[arg(long)]
    pub disable_log_stats: bool,

    #[command(flatten)]
    pub access_log: AccessLogArgs,

    #[command(flatten)]
    pub compat: CompatArgs,

    #[command(flatten)]
    pub speculative: SpeculativeArgs,

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
pub enum Dtype {
    Auto,
    #[value(alias = "bf16")]
    Bfloat16,
    #[value(alias = "half", alias = "fp16")]
    Float16,
    #[value(alias = "float", alias = "fp32")]
    Float32,
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

/// vLLM spells the parallel sizes `-tp` and `-dp`; clap's short flags are one letter, so they
/// are rewritten to the long names before parsing. `vllm serve MODEL` pasted as
/// `mla-serve serve MODEL` loses its `serve`.
pub fn normalize<A: Into<OsString>>(args: impl IntoIterator<Item = A>) -> Vec<OsString> {
    let rewrite = |a: &str| match a.split_once('=') {
        _ if a == "-tp" || a == "-dp" => Some(format!("-{a}")),
        Some((flag @ ("-tp" | "-dp"), value)) => Some(format!("-{flag}={value}")),
        _ => None,
    };
    args.into_iter()
        .map(Into::into)
        .enumerate()
        .filter(|(i, a): &(usize, OsString)| !(*i == 1 && a == "serve"))
        .map(|(_, a)| a.to_str().and_then(rewrite).map(OsString::from).unwrap_or(a))
        .collect()
}

fn parse_reasoning_parser(name: &str) -> Result<ReasoningParserKind, String> {
    ReasoningParserKind::from_name(name)
}

fn parse_tool_call_parser(name: &str) -> Result<ToolParserKind, String> {
    ToolParserKind::from_name(name)
}

impl Args {
    /// The output parser flags; auto tool choice without a parser is refused, as vLLM does.
    pub fn parsers(&self) -> anyhow::Result<ParserConfig> {
        if self.enable_auto_tool_choice && self.tool_call_parser.is_none() {
            anyhow::bail!(
                "--enable-auto-tool-choice needs --tool-call-parser NAME (known: {})",
                ToolParserKind::NAMES.join(", ")
            );
        }
        Ok(ParserConfig {
            reasoning: self.reasoning_parser,
            tool_call: self.tool_call_parser,
            enable_auto_tool_choice: self.enable_auto_tool_choice,
        })
    }

    /// Folds the positional model into `--model` (they may not disagree) and logs what the
    /// vLLM compatibility flags did; called once after parsing.
    pub fn settle(&mut self) -> anyhow::Result<()> {
        match (&self.model, self.model_positional.take()) {
            (Some(flag), Some(pos)) if *flag != pos => {
                anyhow::bail!("the model is given twice, as {pos} and as --model {flag}; give it once")
            }
            (_, Some(pos)) => self.model = Some(pos),
            _ => {}
        }
        // vLLM reads its key from VLLM_API_KEY: a deployment that sets it must not come up open.
        if self.api_key.is_none() {
            if let Some(key) = std::env::var("VLLM_API_KEY").ok().filter(|k| !k.is_empty()) {
                tracing::info!("API key from VLLM_API_KEY (vLLM's variable)");
                self.api_key = Some(key);
            }
        }
        if self.trust_remote_code {
            tracing::info!("--trust-remote-code: DeepSeek-V2/V3 need no remote code; nothing is run");
        }
        self.access_log.explain();
        self.compat.explain();
        Ok(())
    }

    /// The name responses and metrics use, then the other accepted names.
    pub fn served_names(&self, default: &str) -> (String, Vec<String>) {
        match self.served_model_name.split_first() {
            Some((first, rest)) => (first.clone(), rest.to_vec()),
            None => (default.to_string(), Vec::new()),
        }
    }

    /// Refuses vLLM's quantization flags this server has no implementation for.
    fn check_quantization(&self) -> anyhow::Result<()> {
        if let Some(method) = &self.quantization {
            // Refused here, before anything loads; model_source applies it to the config.
            mla_core::model::config::check_quantization_method(method).map_err(anyhow::Error::msg)?;
        }
        self.kv_cache_dtype()?;
        Ok(())
    }

    /// What the latent cache stores (`--kv-cache-dtype`).
    pub fn kv_cache_dtype(&self) -> anyhow::Result<KvCacheDtype> {
        KvCacheDtype::parse(&self.kv_cache_dtype).map_err(anyhow::Error::msg)
    }

    /// Refuses a --dtype the chosen backend does not compute in (cuda: bfloat16, cpu: float32), and
    /// a bf16 KV cache on the CPU.
    pub fn check_dtype(&self, on_cuda: bool) -> anyhow::Result<()> {
        let (native, device) = if on_cuda { (Dtype::Bfloat16, "cuda") } else { (Dtype::Float32, "cpu") };
        if self.dtype != Dtype::Auto && self.dtype != native {
            let name = |d: Dtype| d.to_possible_value().map_or(String::new(), |v| v.get_name().to_string());
            anyhow::bail!(
                "--dtype {}: the {device} backend computes in {} only; use --dtype auto",
                name(self.dtype),
                name(native)
            );
        }
        // vLLM's `bfloat16` names the compute dtype, which the CPU cache is not (it holds f32).
        if !on_cuda && self.kv_cache_dtype == "bfloat16" {
            anyhow::bail!("--kv-cache-dtype bfloat16: the cpu backend's cache holds float32 (auto) or fp8");
        }
        Ok(())
    }

    pub fn watchdog(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.watchdog_timeout)
    }

    /// `--hf-overrides` as a JSON object (empty without the flag).
    pub fn hf_overrides(&self) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
        let Some(text) = &self.hf_overrides else { return Ok(Default::default()) };
        mla_core::model::json_patch::parse_overrides(text).map_err(anyhow::Error::msg)
    }

    /// The parallel layout the flags ask for (model-independent checks only; `Parallel::check`
    /// does the model's).
    pub fn parallel(&self) -> anyhow::Result<Parallel> {
        Ok(Parallel::from_flags(self.tp, self.dp, self.enable_dp_attention)?)
    }

    /// `--max-num-batched-tokens`, or its default.
    pub fn max_num_batched_tokens(&self) -> usize {
        self.max_num_batched_tokens.unwrap_or(DEFAULT_MAX_NUM_BATCHED_TOKENS)
    }

    /// `--long-prefill-token-threshold`, `None` when 0 (no cap below the step's budget).
    pub fn long_prefill_token_threshold(&self) -> Option<usize> {
        (self.long_prefill_token_threshold > 0).then_some(self.long_prefill_token_threshold)
    }

    /// What the flags ask of one step of one attention rank, and the limits of `parallel`'s
    /// steps derived from it (`StepLimits::derive`), with what it adjusted.
    pub fn step_limits(&self, parallel: &Parallel) -> anyhow::Result<(StepLimits, Vec<String>)> {
        let budget = StepBudget {
            max_num_batched_tokens: self.max_num_batched_tokens(),
            max_num_seqs: self.max_num_seqs,
            max_extra_logit_rows: DEFAULT_EXTRA_LOGIT_ROWS,
        };
        Ok(StepLimits::derive(budget, parallel.attention_ranks())?)
    }

    /// Resolves `--device auto` and refuses flags the chosen device cannot honour.
    pub fn check_supported(&self) -> anyhow::Result<Device> {
        self.check_quantization()?;
        let parallel = self.parallel()?;
        self.check_nodes(&parallel)?;
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
        if !(self.dist_timeout.is_finite() && self.dist_timeout > 0.0) {
            anyhow::bail!("--dist-timeout must be a positive number of seconds, got {}", self.dist_timeout);
        }
        if !(self.watchdog_timeout.is_finite() && self.watchdog_timeout > 0.0) {
            anyhow::bail!("--watchdog-timeout must be a positive number of seconds, got {}", self.watchdog_timeout);
        }
        if !(self.shutdown_timeout.is_finite() && self.shutdown_timeout >= 0.0) {
            anyhow::bail!("--shutdown-timeout must be a non-negative number of seconds, got {}", self.shutdown_timeout);
        }
        for (flag, v) in [
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens()),
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
        self.routing.check(parallel.attention_ranks() * parallel.replicas, !self.no_enable_prefix_caching)?;
        self.http.check()?;
        self.access_log.check()?;
        self.compat.check()?;
        self.speculative.check()?;
        self.cors.layer()?;
        Ok(device)
    }

    /// `--nnodes`, `--node-rank` and `--dist-init-addr` agree with each other and the layout.
    fn check_nodes(&self, parallel: &Parallel) -> anyhow::Result<()> {
        let (n, rank) = (self.nnodes, self.node_rank);
        if n == 0 {
            anyhow::bail!("--nnodes must be at least 1");
        }
        if rank >= n {
            anyhow::bail!("--node-rank {rank} is not below --nnodes {n}: nodes are numbered 0..{n}");
        }
        if n == 1 {
            if let Some(addr) = &self.dist_init_addr {
                anyhow::bail!("--dist-init-addr {addr} is for several nodes; give --nnodes too, or leave it out");
            }
            return Ok(());
        }
        let Some(addr) = &self.dist_init_addr else {
            anyhow::bail!("--nnodes {n} needs --dist-init-addr HOST:PORT, where node 0 listens for the others");
        };
        if addr
            .rsplit_once(':')
            .and_then(|(h, p)| (!h.is_empty()).then_some(p))
            .and_then(|p| p.parse::<u16>().ok())
            .is_none()
        {
            anyhow::bail!("--dist-init-addr {addr}: expected HOST:PORT, e.g. 10.0.0.1:5000");
        }
        if parallel.replicas > 1 {
            anyhow::bail!(
                "--dp {} across --nnodes {n}: spreading replicas over nodes is not implemented; run one server per node behind your load balancer, or span the nodes with --tp",
                parallel.replicas
            );
        }
        if !parallel.tp.is_multiple_of(n) {
            anyhow::bail!(
                "--tp {} does not split over --nnodes {n}: every node must hold the same number of ranks",
                parallel.tp
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Args {
        Args::try_parse_from(normalize(std::iter::once("mla-serve").chain(args.iter().copied()))).unwrap()
    }

    #[test]
    fn defaults_match_the_documented_ones() {
        let a = parse(&[]);
        assert_eq!((a.port, a.block_size, a.tp), (8000, 64, 1));
        assert_eq!(a.check_supported().unwrap(), Device::Auto);
    }

    #[test]
    fn long_prefill_token_threshold_is_off_at_zero_as_in_vllm() {
        assert_eq!(parse(&[]).long_prefill_token_threshold(), None);
        assert_eq!(parse(&["--long-prefill-token-threshold", "0"]).long_prefill_token_threshold(), None);
        assert_eq!(parse(&["--long-prefill-token-threshold", "512"]).long_prefill_token_threshold(), Some(512));
    }

    #[test]
    fn mixed_steps_are_on_unless_turned_off_and_the_last_flag_wins() {
        let on = |a: &[&str]| !parse(a).no_enable_mixed_chunk;
        assert!(on(&[]));
        assert!(on(&["--enable-mixed-chunk"]));
        assert!(!on(&["--disable-mixed-chunk"]));
        assert!(!on(&["--enable-mixed-chunk", "--no-enable-mixed-chunk"]));
        assert!(on(&["--disable-mixed-chunk", "--enable-mixed-chunk"]));
    }

    #[test]
    fn prefix_caching_is_on_unless_turned_off_and_the_last_flag_wins() {
        let on = |a: &[&str]| !parse(a).no_enable_prefix_caching;
        assert!(on(&[]));
        assert!(on(&["--enable-prefix-caching"]));
        assert!(!on(&["--no-enable-prefix-caching"]));
        assert!(!on(&["--disable-radix-cache"]));
        assert!(on(&["--no-enable-prefix-caching", "--enable-prefix-caching"]));
        assert!(!on(&["--enable-prefix-caching", "--no-enable-prefix-caching"]));
    }

    #[test]
    fn parallel_flags_take_vllm_and_sglang_spellings() {
        let layout = |args: &[&str]| parse(args).parallel().unwrap();
        assert_eq!(
            layout(&["--tp", "8", "--enable-dp-attention"]),
            Parallel { tp: 8, dp_attention: true, replicas: 1 }
        );
        assert_eq!(layout(&["-tp", "4"]).tp, 4);
        assert_eq!(layout(&["-tp=2", "-dp=3"]), Parallel { tp: 2, dp_attention: false, replicas: 3 });
        assert_eq!(layout(&["--tensor-parallel-size", "2", "--data-parallel-size", "2"]).devices(), 4);
        assert_eq!(layout(&["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]).attention_ranks(), 2);
        // Only the exact flags are rewritten, never values.
        assert_eq!(normalize(["--served-model-name", "-tp"]), vec!["--served-model-name", "--tp"]);
        assert_eq!(normalize(["--api-key", "-tpx"]), vec!["--api-key", "-tpx"]);
    }

    #[test]
    fn node_flags_are_checked_together() {
        assert!(parse(&["--tp", "4", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:5000"]).check_supported().is_ok());
        for (args, needle) in [
            (&["--nnodes", "2", "--tp", "2"][..], "needs --dist-init-addr"),
            (&["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"][..], "--node-rank 2 is not below"),
            (&["--nnodes", "0"][..], "--nnodes must be"),
            (&["--dist-init-addr", "h:1"][..], "give --nnodes"),
            (&["--nnodes", "2", "--tp", "2", "--dist-init-addr", "nohost"][..], "HOST:PORT"),
            (&["--nnodes", "2", "--tp", "2", "--dist-init-addr", "h:99999"][..], "HOST:PORT"),
            (&["--nnodes", "2", "--tp", "3", "--dist-init-addr", "h:1"][..], "does not split over --nnodes 2"),
            (&["--nnodes", "2", "--dp", "2", "--dist-init-addr", "h:1"][..], "replicas over nodes"),
        ] {
            let err = parse(args).check_supported().unwrap_err().to_string();
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }

    #[test]
    fn unimplemented_features_fail_with_a_reason() {
        for (args, needle) in [
            (&["--enable-dp-attention"][..], "--tp 2 or more"),
            (&["--tp", "8", "--dp", "2", "--enable-dp-attention"][..], "attention-TP groups"),
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
