//! `mla-bench`: the project's benchmark tool.
//! - `kernels`: micro-benchmarks of the CUDA kernels (attention, MoE experts) and of one decode
//!   step, on the GPU.
//! - `engine`: the real engine + CUDA backend offline (no HTTP): prefill and decode throughput.
//! - `host`: the host work between decode steps on the CPU alone (real engine, instant backend).
//! - `profile`: eager steps between cuProfilerStart/Stop, for a per-kernel breakdown under ncu.
//! - `collectives`: NCCL all-reduce, all-gather and reduce-scatter at the sizes the multi-GPU
//!   steps move, eager and from CUDA graphs, one thread per GPU.
//! - `grammar-mask`: the CPU cost of a structured-output token mask per decode step (llguidance
//!   over a DeepSeek-V3-sized vocabulary), at batch 1 and 64.
//! - `prefix-lookup`: the CPU cost of routing a request by prefix (hashing its blocks, looking
//!   them up in every rank's cache index) for a long prompt over many ranks.
//! - `serve`: a load generator against any OpenAI-compatible server that stands in for
//!   `vllm bench serve`: its flags, datasets, metric definitions, table and result file.
//!
//! Every JSON result carries the GPU, the UTC date, the commit (`MLA_GIT_COMMIT`) and the command.

mod collectives;
mod dummy_model;
mod engine_bench;
mod grammar_mask;
mod host_bench;
mod kernels;
mod prefix_lookup;
mod profile;
mod report;
mod serve;
mod spec_step;

use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "mla-bench", about = "Benchmarks of mla-serve")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// CUDA kernel micro-benchmarks on the DeepSeek-V2-Lite shape, timed with CUDA events.
    Kernels {
        /// Benchmarks to run, comma separated (they run in the order listed below).
        #[arg(long, value_enum, value_delimiter = ',', default_value = "decode_attention,prefill_attention")]
        only: Vec<kernels::Bench>,
        /// Model config of the decode_step benchmark (dummy weights of this shape).
        #[arg(long, default_value = "configs/deepseek-v2-lite.json")]
        config: PathBuf,
        /// Where to write the JSON report.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Offline engine benchmark on the CUDA backend with dummy weights.
    Engine {
        #[arg(long, default_value = "configs/deepseek-v2-lite.json")]
        config: PathBuf,
        #[arg(long, default_value_t = 0.9)]
        gpu_memory_utilization: f64,
        #[arg(long, default_value_t = 256)]
        max_num_seqs: usize,
        #[arg(long, default_value_t = 8192)]
        max_num_batched_tokens: usize,
        #[arg(long, default_value_t = 8192)]
        max_model_len: usize,
        /// Prompt length of the prefill measurement.
        #[arg(long, default_value_t = 4096)]
        prefill_len: usize,
        #[arg(long, default_value_t = 5)]
        prefill_reps: usize,
        /// Decode cases as BATCHxCONTEXTxSTEPS, comma separated.
        #[arg(long, default_value = "1x1024x256,64x4096x64,256x4096x64")]
        decode: String,
        /// Run every step eagerly (no CUDA graphs), for the before/after comparison.
        #[arg(long)]
        no_cuda_graphs: bool,
        /// Small-batch linear layers through cuBLAS instead of the GEMV kernel.
        #[arg(long)]
        no_gemv: bool,
        /// Tensor-parallel GPUs (as mla-serve's --tp).
        #[arg(long, default_value_t = 1)]
        tp: usize,
        /// Replicas, or with --enable-dp-attention the DP size (as mla-serve's --dp). Decode
        /// batches (--decode) are totals over the whole layout.
        #[arg(long)]
        dp: Option<usize>,
        #[arg(long)]
        enable_dp_attention: bool,
        /// As mla-serve's: `fp8` makes the linear weights block-FP8 (quantized on the device).
        #[arg(long, value_name = "METHOD")]
        quantization: Option<String>,
        /// As mla-serve's: config fields to override, e.g. '{"num_hidden_layers": 6}'.
        #[arg(long, value_name = "JSON")]
        hf_overrides: Option<String>,
        /// FP8 projections past the GEMV through dequantize + bf16 cuBLAS instead of W8A8.
        #[arg(long)]
        no_fp8_w8a8: bool,
        /// As mla-serve's: `fp8` stores the latent cache in FP8 rows.
        #[arg(long, default_value = "auto", value_name = "DTYPE")]
        kv_cache_dtype: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Host time between decode steps without a GPU: the real engine and an instant backend
    /// (optionally doing the CUDA backend's host-side metadata work and thread hand-off).
    Host {
        #[arg(long, default_value = "configs/deepseek-v2-lite.json")]
        config: PathBuf,
        #[arg(long, default_value_t = 256)]
        batch: usize,
        #[arg(long, default_value_t = 4096)]
        context: usize,
        #[arg(long, default_value_t = 200)]
        steps: usize,
        #[arg(long, default_value_t = 256)]
        max_num_seqs: usize,
        #[arg(long, default_value_t = 8192)]
        max_num_batched_tokens: usize,
        #[arg(long, default_value_t = 8192)]
        max_model_len: usize,
        /// Skip the CUDA backend's host work (validate, pad, StepMeta::build, staging copy).
        #[arg(long)]
        no_cuda_meta: bool,
        /// Run steps on the engine thread instead of a worker thread (as CudaBackend does).
        #[arg(long)]
        inline: bool,
        /// Simulated device time per step in microseconds (the worker sleeps).
        #[arg(long, default_value_t = 0)]
        step_us: u64,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Eager decode steps and one prefill step between cuProfilerStart/Stop (run under ncu with
    /// --profile-from-start off for a per-kernel breakdown).
    Profile {
        /// Model config (dummy weights of this shape).
        #[arg(long, default_value = "configs/deepseek-v2-lite.json")]
        config: PathBuf,
        /// Batch sizes, comma separated: one decode step each, in this order.
        #[arg(long, value_delimiter = ',', default_value = "256")]
        batch: Vec<usize>,
        /// Context of every decode sequence (random latents stand in for it).
        #[arg(long, default_value_t = 4096)]
        context: usize,
        /// Prompt length of the prefill step (0: no prefill step).
        #[arg(long, default_value_t = 4096)]
        prefill_len: usize,
        /// As mla-serve's: `fp8` makes the linear weights block-FP8 (quantized on the device).
        #[arg(long, value_name = "METHOD")]
        quantization: Option<String>,
        /// As mla-serve's: config fields to override, e.g. '{"num_hidden_layers": 6}'.
        #[arg(long, value_name = "JSON")]
        hf_overrides: Option<String>,
    },
    /// Speculative decoding with the MTP module: the plain decode step against the verify step
    /// and the whole speculative step at forced acceptance rates (benchmark only), per batch
    /// size and drafts per step, on dummy weights with an MTP module.
    SpecStep {
        /// Model config (dummy weights of this shape; it must declare an MTP layer).
        #[arg(long, default_value = "configs/deepseek-v3.json")]
        config: PathBuf,
        #[arg(long, value_delimiter = ',', default_value = "1,4,16,32,64,128,256")]
        batch: Vec<usize>,
        /// Drafts per step (K), comma separated.
        #[arg(long, value_delimiter = ',', default_value = "1,2")]
        drafts: Vec<usize>,
        /// Forced acceptance rates per draft, comma separated.
        #[arg(long, value_delimiter = ',', default_value = "0,0.6,0.8,0.9")]
        acceptance: Vec<f64>,
        #[arg(long, default_value_t = 1024)]
        context: usize,
        /// Sampling temperature of every sequence (0: greedy). Above 0 the drafts are drawn and
        /// verified by rejection sampling on the device (the acceptance is still forced).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Top-p of the sampled sequences (1: off).
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Run the MTP passes eagerly instead of replaying their CUDA graphs (A/B runs).
        #[arg(long)]
        eager_mtp: bool,
        /// As mla-serve's: `fp8` makes the linear weights block-FP8 (quantized on the device).
        #[arg(long, value_name = "METHOD")]
        quantization: Option<String>,
        /// As mla-serve's: config fields to override, e.g. '{"num_hidden_layers": 6}'.
        #[arg(long, value_name = "JSON")]
        hf_overrides: Option<String>,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// NCCL collectives at the sizes a multi-GPU step moves (TP all-reduce, DP-attention gathers
    /// and reduce-scatters), eager and replayed from CUDA graphs.
    Collectives {
        /// GPUs (ranks), one thread each.
        #[arg(long, default_value_t = 2)]
        gpus: usize,
        /// Model hidden size (V2-Lite 2048, V2 5120, V3 7168).
        #[arg(long, default_value_t = 2048)]
        hidden: usize,
        /// Tokens per rank, one case each, comma separated.
        #[arg(long, value_delimiter = ',', default_value = "1,8,32,128,256,1024,4096,8192")]
        rows: Vec<usize>,
        /// Collectives per timed batch and per captured graph.
        #[arg(long, default_value_t = 50)]
        iters: usize,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Structured output: CPU time of one grammar token mask (a JSON schema) per draw, on a
    /// V3-sized vocabulary (synthetic unless --tokenizer), at the batch sizes given.
    GrammarMask {
        /// A model directory with tokenizer.json (a real DeepSeek-V3 one, say).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// The model's vocab_size (masks cover it all); DeepSeek-V3's by default.
        #[arg(long, default_value_t = 129_280)]
        vocab_size: usize,
        /// Decode steps timed per batch size.
        #[arg(long, default_value_t = 200)]
        steps: usize,
        #[arg(long, value_delimiter = ',', default_value = "1,64")]
        batch: Vec<usize>,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Prefix routing: CPU time to hash a prompt's blocks and look them up in every rank's
    /// cache index, as the router does for each request under --dp and DP attention.
    PrefixLookup {
        #[arg(long, default_value_t = 131_072)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 8)]
        ranks: usize,
        #[arg(long, default_value_t = 64)]
        block_size: usize,
        /// Blocks each rank's cache holds (16,384 blocks of 64: a million tokens).
        #[arg(long, default_value_t = 16_384)]
        cached_blocks: usize,
        /// Changes (registrations and evictions) each rank makes between two lookups.
        #[arg(long, default_value_t = 4096)]
        pending: usize,
        #[arg(long, default_value_t = 200)]
        reps: usize,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Load generator against any OpenAI-compatible server, a drop-in for `vllm bench serve`:
    /// its flags, datasets, metric definitions, table and result file.
    Serve(Box<serve::ServeArgs>),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::Kernels { only, config, out } => kernels::run(&only, &config, out.as_deref()),
        Cmd::Engine {
            config,
            gpu_memory_utilization,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            prefill_len,
            prefill_reps,
            decode,
            no_cuda_graphs,
            no_gemv,
            tp,
            dp,
            enable_dp_attention,
            quantization,
            hf_overrides,
            no_fp8_w8a8,
            kv_cache_dtype,
            seed,
            out,
        } => {
            let args = engine_bench::EngineArgs {
                kv_cache_dtype: mla_core::KvCacheDtype::parse(&kv_cache_dtype).map_err(anyhow::Error::msg)?,
                quantization,
                hf_overrides,
                fp8_w8a8: !no_fp8_w8a8,
                parallel: mla_core::Parallel::from_flags(tp, dp, enable_dp_attention)?,
                config,
                gpu_memory_utilization,
                max_num_seqs,
                max_num_batched_tokens,
                max_model_len,
                prefill_len,
                prefill_reps,
                decode: engine_bench::parse_decode(&decode)?,
                graphs: !no_cuda_graphs,
                gemv: !no_gemv,
                seed,
            };
            let r = engine_bench::run(&args)?;
            let gpu = r["gpu"].as_str().unwrap_or("unknown").to_string();
            let v = report::envelope(&gpu, r);
            println!("{}", serde_json::to_string_pretty(&v)?);
            report::write(out.as_deref(), &v)
        }
        Cmd::Host {
            config,
            batch,
            context,
            steps,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            no_cuda_meta,
            inline,
            step_us,
            seed,
            out,
        } => {
            let args = host_bench::HostArgs {
                config,
                batch,
                context,
                steps,
                max_num_seqs,
                max_num_batched_tokens,
                max_model_len,
                cuda_meta: !no_cuda_meta,
                thread: !inline,
                step_us,
                seed,
            };
            let r = host_bench::run(&args)?;
            eprintln!(
                "host B={batch} ctx={context}: between steps median {:.1} us (p90 {:.1}), CUDA metadata prep median {:.1} us (p90 {:.1}), total median {:.1} us",
                r["between_steps_us"]["median"].as_f64().unwrap_or(0.0),
                r["between_steps_us"]["p90"].as_f64().unwrap_or(0.0),
                r["cuda_meta_prep_us"]["median"].as_f64().unwrap_or(0.0),
                r["cuda_meta_prep_us"]["p90"].as_f64().unwrap_or(0.0),
                r["host_total_us"]["median"].as_f64().unwrap_or(0.0),
            );
            let v = report::envelope("none (CPU only)", r);
            println!("{}", serde_json::to_string_pretty(&v)?);
            report::write(out.as_deref(), &v)
        }
        Cmd::Collectives { gpus, hidden, rows, iters, out } => {
            let v = collectives::run(&collectives::CollectiveArgs { gpus, hidden, rows, iters })?;
            report::write(out.as_deref(), &v)
        }
        Cmd::SpecStep {
            config,
            batch,
            drafts,
            acceptance,
            context,
            temperature,
            top_p,
            eager_mtp,
            quantization,
            hf_overrides,
            out,
        } => {
            let cfg = dummy_model::config(&config, hf_overrides.as_deref(), quantization.as_deref())?;
            let sampling = mla_core::SamplingParams { temperature, top_p, ..mla_core::SamplingParams::greedy() };
            let args =
                spec_step::SpecStepArgs { cfg, batches: batch, drafts, acceptance, context, sampling, eager_mtp };
            let r = spec_step::run(&args)?;
            let gpu = r["gpu"].as_str().unwrap_or("").to_string();
            let v = report::envelope(&gpu, r);
            report::write(out.as_deref(), &v)
        }
        Cmd::Profile { config, batch, context, prefill_len, quantization, hf_overrides } => {
            let cfg = dummy_model::config(&config, hf_overrides.as_deref(), quantization.as_deref())?;
            profile::run(cfg, &batch, context, prefill_len)
        }
        Cmd::GrammarMask { tokenizer, vocab_size, steps, batch, out } => {
            let r = grammar_mask::run(&grammar_mask::GrammarMaskArgs { tokenizer, vocab_size, steps, batches: batch })?;
            let v = report::envelope("none (CPU only)", r);
            println!("{}", serde_json::to_string_pretty(&v)?);
            report::write(out.as_deref(), &v)
        }
        Cmd::PrefixLookup { prompt_tokens, ranks, block_size, cached_blocks, pending, reps, out } => {
            let r = prefix_lookup::run(&prefix_lookup::PrefixLookupArgs {
                prompt_tokens,
                ranks,
                block_size,
                cached_blocks,
                pending,
                reps,
            })?;
            let v = report::envelope("none (CPU only)", r);
            println!("{}", serde_json::to_string_pretty(&v)?);
            report::write(out.as_deref(), &v)
        }
        Cmd::Serve(args) => serve::main(*args),
    }
}
