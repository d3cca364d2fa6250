//! `mla-bench`: the project's benchmark tool.
//! - `kernels`: micro-benchmarks of the CUDA kernels (attention, MoE experts) and of one decode
//!   step, on the GPU.
//! - `engine`: the real engine + CUDA backend offline (no HTTP): prefill and decode throughput.
//! - `host`: the host work between decode steps on the CPU alone (real engine, instant backend).
//! - `profile`: eager steps between cuProfilerStart/Stop, for a per-kernel breakdown under ncu.
//! - `collectives`: NCCL all-reduce, all-gather and reduce-scatter at the sizes the multi-GPU
//!   steps move, eager and from CUDA graphs, one thread per GPU.
//! - `serve`: a load generator against any OpenAI-compatible server, with `vllm bench serve`'s
//!   metric definitions, as a table and as JSON.
//!
//! Every JSON result carries the GPU, the UTC date, the commit (`MLA_GIT_COMMIT`) and the command.

mod collectives;
mod dataset;
mod dummy_model;
mod engine_bench;
mod host_bench;
mod kernels;
mod metrics;
mod profile;
mod report;
mod serve;

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
    /// Load generator against an OpenAI-compatible server (`/v1/completions`, streamed).
    Serve {
        #[arg(long, default_value = "http://127.0.0.1:8000")]
        base_url: String,
        /// Model name to send (default: the first `/v1/models` lists).
        #[arg(long)]
        model: Option<String>,
        /// `random`; `file`; `prefix-repetition` (vLLM's: --num-prefixes shared prefixes of
        /// --prefix-len ids, then --input-len ids of each prompt's own); `multi-turn`
        /// (--num-prompts conversations of --num-turns turns, each turn adding --input-len ids
        /// to the history, which holds the earlier replies too; one conversation per slot of
        /// --max-concurrency).
        #[arg(long, default_value = "random")]
        dataset: String,
        #[arg(long, default_value_t = 2000)]
        prefix_len: usize,
        #[arg(long, default_value_t = 1)]
        num_prefixes: usize,
        #[arg(long, default_value_t = 8)]
        num_turns: usize,
        /// JSONL file for `--dataset file`: {"prompt": "text" | [ids], "max_tokens": n}.
        #[arg(long)]
        dataset_path: Option<PathBuf>,
        #[arg(long, default_value_t = 1024)]
        input_len: usize,
        #[arg(long, default_value_t = 256)]
        output_len: usize,
        /// Random prompts draw token ids uniformly from this range (lo..hi).
        #[arg(long, default_value = "100..30000")]
        token_id_range: String,
        #[arg(long, default_value_t = 1000)]
        num_prompts: usize,
        #[arg(long, default_value_t = 256)]
        max_concurrency: usize,
        /// Requests per second (Poisson arrivals); `inf` sends all at once.
        #[arg(long, default_value = "inf")]
        request_rate: f64,
        #[arg(long)]
        ignore_eos: bool,
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// GPU name to record in the JSON (the server runs elsewhere).
        #[arg(long, default_value = "unknown")]
        gpu: String,
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

fn parse_range(s: &str) -> anyhow::Result<(u32, u32)> {
    let (a, b) = s.split_once("..").ok_or_else(|| anyhow::anyhow!("--token-id-range {s}: expected LO..HI"))?;
    let (a, b): (u32, u32) = (a.trim().parse()?, b.trim().parse()?);
    anyhow::ensure!(a < b, "--token-id-range {s}: empty");
    Ok((a, b))
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
            seed,
            out,
        } => {
            let args = engine_bench::EngineArgs {
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
        Cmd::Profile { config, batch, context, prefill_len } => profile::run(&config, &batch, context, prefill_len),
        Cmd::Serve {
            base_url,
            model,
            dataset: ds,
            prefix_len,
            num_prefixes,
            num_turns,
            dataset_path,
            input_len,
            output_len,
            token_id_range,
            num_prompts,
            max_concurrency,
            request_rate,
            ignore_eos,
            temperature,
            seed,
            gpu,
            out,
        } => {
            let ids = parse_range(&token_id_range)?;
            let mut conversations = None;
            let prompts = match ds.as_str() {
                "random" => dataset::random(num_prompts, input_len, output_len, ids, seed),
                "file" => dataset::from_file(
                    &dataset_path.ok_or_else(|| anyhow::anyhow!("--dataset file needs --dataset-path"))?,
                    num_prompts,
                    output_len,
                )?,
                "prefix-repetition" => {
                    dataset::prefix_repetition(num_prompts, prefix_len, input_len, num_prefixes, output_len, ids, seed)
                }
                "multi-turn" => {
                    conversations = Some(dataset::conversations(num_prompts, num_turns, input_len, ids, seed));
                    vec![]
                }
                other => anyhow::bail!("--dataset {other}: expected random, file, prefix-repetition or multi-turn"),
            };
            let target = serve::Target::parse(&base_url)?;
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let model = match model {
                Some(m) => m,
                None => rt.block_on(serve::first_model(&target))?,
            };
            let o = serve::LoadOptions {
                model: model.clone(),
                request_rate,
                max_concurrency,
                ignore_eos,
                temperature,
                seed,
            };
            let (records, dur) = match conversations {
                Some(c) => rt.block_on(serve::run_conversations(target, o, c, output_len)),
                None => rt.block_on(serve::run(target, o, prompts)),
            };
            if let Some(e) = records.iter().find_map(|r| r.error.as_ref()) {
                eprintln!("first failure: {e}");
            }
            let m = metrics::calculate(&records, dur.as_secs_f64());
            println!("{}", metrics::table(&m));
            let v = report::envelope(
                &gpu,
                serde_json::json!({
                    "base_url": base_url, "model": model, "dataset": ds, "input_len": input_len, "output_len": output_len,
                    "prefix_len": prefix_len, "num_prefixes": num_prefixes, "num_turns": num_turns,
                    "num_prompts": num_prompts, "max_concurrency": max_concurrency, "request_rate": if request_rate.is_finite() { serde_json::json!(request_rate) } else { serde_json::json!("inf") },
                    "ignore_eos": ignore_eos, "temperature": temperature, "metrics": m,
                }),
            );
            report::write(out.as_deref(), &v)
        }
    }
}
