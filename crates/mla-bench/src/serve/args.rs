//! `mla-bench serve`'s flags: `vllm bench serve`'s names, defaults and meanings (vLLM 0.33),
//! so a vLLM command line runs unchanged, plus the earlier mla-bench spellings as aliases
//! (`--dataset`, `--prefix-len`, `--num-prefixes`, `prefix-repetition`) because recorded runs
//! use them, and mla-bench's own additions (`multi-turn` and `file` datasets,
//! `--token-id-range`, `--gpu`, `--out`).

use super::metrics::{Metric, Slo};
use super::request::Backend;
use clap::{Args, ValueEnum};
use serde_json::{Map, Value};
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DatasetName {
    /// Random token ids: --random-input-len (± --random-range-ratio) after a shared
    /// --random-prefix-len prefix, asking for --random-output-len tokens.
    Random,
    /// A ShareGPT JSON file (--dataset-path): first turns as prompts, the replies' lengths as
    /// output lengths (needs the tokenizer).
    Sharegpt,
    /// --prefix-repetition-num-prefixes shared prefixes of --prefix-repetition-prefix-len ids,
    /// each prompt adding --prefix-repetition-suffix-len ids of its own.
    #[value(name = "prefix_repetition", alias = "prefix-repetition")]
    PrefixRepetition,
    /// mla-bench's: --num-prompts conversations of --num-turns turns, each turn adding
    /// --input-len ids to a history that holds the earlier replies; one conversation per
    /// --max-concurrency slot.
    #[value(name = "multi-turn")]
    MultiTurn,
    /// mla-bench's: a JSONL file (--dataset-path) of {"prompt": "text" | [ids], "max_tokens": n}.
    File,
}

impl DatasetName {
    pub fn name(self) -> &'static str {
        match self {
            DatasetName::Random => "random",
            DatasetName::Sharegpt => "sharegpt",
            DatasetName::PrefixRepetition => "prefix_repetition",
            DatasetName::MultiTurn => "multi-turn",
            DatasetName::File => "file",
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    // Where to send.
    /// The API: openai (/v1/completions; `vllm` is accepted too) or openai-chat (/v1/chat/completions).
    #[arg(long, value_enum, default_value = "openai")]
    pub backend: Backend,
    /// Server URL, http:// or https:// (default: http://--host:--port).
    #[arg(long)]
    pub base_url: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// API path (default: the backend's, /v1/completions or /v1/chat/completions).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Extra request headers, KEY=VALUE. The API key comes from OPENAI_API_KEY.
    #[arg(long, num_args = 1..)]
    pub header: Vec<String>,
    /// Do not verify the server's TLS certificate.
    #[arg(long)]
    pub insecure: bool,
    /// Model id (default: the first `/v1/models` lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Model name sent in requests, when it differs from --model.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// tokenizer.json, a directory holding one, or a HF repo id in the local cache (default:
    /// the model id, when it is one of those).
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Use no tokenizer on the client.
    #[arg(long)]
    pub skip_tokenizer_init: bool,
    /// Prefix of each request's x-request-id (default: bench-<8 random hex digits>-).
    #[arg(long)]
    pub request_id_prefix: Option<String>,

    // What to send.
    #[arg(long, alias = "dataset", value_enum, default_value = "random")]
    pub dataset_name: DatasetName,
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Input length for any dataset: --random-input-len, prefix_repetition's suffix length,
    /// multi-turn's tokens per turn.
    #[arg(long)]
    pub input_len: Option<usize>,
    /// Output length for any dataset (random, sharegpt, prefix_repetition, multi-turn, file).
    #[arg(long)]
    pub output_len: Option<usize>,
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    /// Input and output lengths drawn uniformly from length·(1 ± ratio), ratio in [0, 1).
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Ids every random prompt starts with, before its own.
    #[arg(long, default_value_t = 0)]
    pub random_prefix_len: usize,
    /// Output length of every ShareGPT request (default: its reply's length).
    #[arg(long)]
    pub sharegpt_output_len: Option<usize>,
    #[arg(long, alias = "prefix-len", default_value_t = 256)]
    pub prefix_repetition_prefix_len: usize,
    #[arg(long, default_value_t = 256)]
    pub prefix_repetition_suffix_len: usize,
    #[arg(long, alias = "num-prefixes", default_value_t = 10)]
    pub prefix_repetition_num_prefixes: usize,
    #[arg(long, default_value_t = 128)]
    pub prefix_repetition_output_len: usize,
    /// Turns per conversation of the multi-turn dataset.
    #[arg(long, default_value_t = 8)]
    pub num_turns: usize,
    /// Seconds a multi-turn conversation waits between an answer and its next turn (a user
    /// reading and typing), drawn uniformly from 0.5 to 1.5 times this so conversations drift
    /// apart; 0 sends the next turn at once. The conversation keeps its concurrency slot.
    #[arg(long, default_value_t = 0.0)]
    pub turn_delay: f64,
    /// Random prompts draw ids from LO..HI (default: the served model's vocabulary).
    #[arg(long)]
    pub token_id_range: Option<String>,
    /// Do not repeat ShareGPT conversations when the file has fewer than --num-prompts.
    #[arg(long)]
    pub no_oversample: bool,
    /// Keep the dataset's order.
    #[arg(long)]
    pub disable_shuffle: bool,

    // How to send.
    /// Requests in flight at most (default: no limit).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Requests per second; inf sends all at once.
    #[arg(long, default_value = "inf")]
    pub request_rate: f64,
    /// Shape of the gamma-distributed gaps between requests: 1 is a Poisson process, below 1
    /// burstier, above 1 more even.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Generate until the output length even past EOS (always on for the random dataset, as in vLLM).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Sampling parameters, sent only when given (the server's defaults otherwise).
    #[arg(long)]
    pub temperature: Option<f64>,
    #[arg(long)]
    pub top_p: Option<f64>,
    #[arg(long)]
    pub top_k: Option<i64>,
    #[arg(long)]
    pub min_p: Option<f64>,
    /// A JSON object merged into every request body.
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Copies of the first prompt sent before the timed run.
    #[arg(long, default_value_t = 0)]
    pub num_warmups: usize,
    /// Retry the initial test request this long while the server comes up (0: one try).
    #[arg(long, default_value_t = 0)]
    pub ready_check_timeout_sec: u64,

    // What to report.
    /// Metrics to report: ttft, tpot, itl, e2el, client_queue_time, e2el_including_client_queue.
    #[arg(long, default_value = "ttft,tpot,itl")]
    pub percentile_metrics: String,
    /// Percentiles reported for each metric, comma separated.
    #[arg(long, default_value = "99")]
    pub metric_percentiles: String,
    /// Service-level objectives for goodput, KEY:VALUE in ms, KEY one of ttft, tpot, e2el.
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<String>,
    /// Write vLLM's result JSON (--result-dir, --result-filename).
    #[arg(long)]
    pub save_result: bool,
    /// Per-request lists in the result (ttfts, itls, generated_texts, errors, ...).
    #[arg(long)]
    pub save_detailed: bool,
    /// Append the result to the file as one more line.
    #[arg(long)]
    pub append_result: bool,
    #[arg(long)]
    pub result_dir: Option<PathBuf>,
    #[arg(long)]
    pub result_filename: Option<String>,
    /// Label in the result and its file name (default: the backend).
    #[arg(long)]
    pub label: Option<String>,
    /// KEY=VALUE pairs written into the result.
    #[arg(long, num_args = 1..)]
    pub metadata: Vec<String>,
    /// Accepted for vLLM's command lines; there is no progress bar.
    #[arg(long)]
    pub disable_tqdm: bool,
    /// GPU name recorded in --out's envelope (the server runs elsewhere).
    #[arg(long, default_value = "unknown")]
    pub gpu: String,
    /// mla-bench's own result file: the command, date, commit, GPU and every metric.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// KEY=VALUE pairs of `--header` and `--metadata`.
pub fn key_values(flag: &str, items: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    items
        .iter()
        .map(|s| {
            let (k, v) = s.split_once('=').ok_or_else(|| anyhow::anyhow!("--{flag} {s:?}: expected KEY=VALUE"))?;
            Ok((k.trim().to_string(), v.trim().to_string()))
        })
        .collect()
}

/// What the flags resolve to once vLLM's general flags are mapped onto the dataset's own.
#[derive(Debug, Clone, PartialEq)]
pub struct Lengths {
    pub input: usize,
    pub output: usize,
}

impl ServeArgs {
    /// The dataset's input and output lengths (for ShareGPT and file, the output length used
    /// when the data gives none).
    pub fn lengths(&self) -> Lengths {
        let (input, output) = match self.dataset_name {
            DatasetName::PrefixRepetition => (self.prefix_repetition_suffix_len, self.prefix_repetition_output_len),
            _ => (self.random_input_len, self.random_output_len),
        };
        Lengths { input: self.input_len.unwrap_or(input), output: self.output_len.unwrap_or(output) }
    }

    /// vLLM ignores EOS for the random dataset whatever the flag says.
    pub fn ignore_eos(&self) -> bool {
        self.ignore_eos || self.dataset_name == DatasetName::Random
    }

    pub fn metrics(&self) -> anyhow::Result<Vec<Metric>> {
        self.percentile_metrics.split(',').filter(|s| !s.trim().is_empty()).map(Metric::parse).collect()
    }

    pub fn percentiles(&self) -> anyhow::Result<Vec<f64>> {
        self.metric_percentiles
            .split(',')
            .map(|s| {
                let p: f64 =
                    s.trim().parse().map_err(|_| anyhow::anyhow!("--metric-percentiles: {s:?} is not a number"))?;
                anyhow::ensure!((0.0..=100.0).contains(&p), "--metric-percentiles: {p} is not in 0..=100");
                Ok(p)
            })
            .collect()
    }

    pub fn slos(&self) -> anyhow::Result<Vec<Slo>> {
        self.goodput.iter().map(|s| Slo::parse(s)).collect()
    }

    /// Sampling parameters given on the command line, then `--extra-body` over them.
    pub fn extra_body(&self) -> anyhow::Result<Map<String, Value>> {
        let mut body = Map::new();
        let sampling = [
            ("temperature", self.temperature.map(Value::from)),
            ("top_p", self.top_p.map(Value::from)),
            ("top_k", self.top_k.map(Value::from)),
            ("min_p", self.min_p.map(Value::from)),
        ];
        for (k, v) in sampling {
            if let Some(v) = v {
                body.insert(k.into(), v);
            }
        }
        if let Some(text) = &self.extra_body {
            let Value::Object(extra) = serde_json::from_str(text).map_err(|e| anyhow::anyhow!("--extra-body: {e}"))?
            else {
                anyhow::bail!("--extra-body: expected a JSON object");
            };
            body.extend(extra);
        }
        Ok(body)
    }

    /// Checks that need no server, so a mistyped command fails at once.
    pub fn validate(&self) -> anyhow::Result<()> {
        let synthetic =
            matches!(self.dataset_name, DatasetName::Random | DatasetName::PrefixRepetition | DatasetName::MultiTurn);
        if synthetic {
            anyhow::ensure!(
                self.dataset_path.is_none(),
                "--dataset-name {} takes no --dataset-path (sharegpt and file read one)",
                self.dataset_name.name()
            );
        } else {
            anyhow::ensure!(
                self.dataset_path.is_some(),
                "--dataset-name {} needs --dataset-path",
                self.dataset_name.name()
            );
        }
        anyhow::ensure!(self.max_concurrency != Some(0), "--max-concurrency must be greater than 0");
        anyhow::ensure!(
            self.turn_delay.is_finite() && self.turn_delay >= 0.0,
            "--turn-delay must be a number of seconds, 0 or more"
        );
        anyhow::ensure!(
            self.turn_delay == 0.0 || self.dataset_name == DatasetName::MultiTurn,
            "--turn-delay is the multi-turn dataset's; --dataset-name {} has no turns",
            self.dataset_name.name()
        );
        anyhow::ensure!(
            !(self.backend == Backend::OpenaiChat && self.dataset_name == DatasetName::MultiTurn),
            "--dataset-name multi-turn sends token ids and needs --backend openai"
        );
        self.metrics()?;
        self.percentiles()?;
        self.slos()?;
        self.extra_body()?;
        key_values("header", &self.header)?;
        key_values("metadata", &self.metadata)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &str) -> ServeArgs {
        Cli::try_parse_from(std::iter::once("serve").chain(args.split_whitespace())).unwrap().serve
    }

    #[test]
    fn a_vllm_command_line_parses_with_vllms_defaults() {
        let a = parse(
            "--backend openai-chat --base-url https://h:443 --endpoint /v1/chat/completions --model m \
             --dataset-name random --random-input-len 100 --random-output-len 20 --random-range-ratio 0.1 \
             --num-prompts 50 --max-concurrency 8 --request-rate 4 --burstiness 0.5 --seed 3 \
             --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --goodput ttft:200 tpot:50 \
             --save-result --result-dir out --result-filename r.json --ignore-eos --disable-tqdm --temperature 0",
        );
        assert_eq!(
            (a.backend, a.dataset_name, a.max_concurrency, a.request_rate),
            (Backend::OpenaiChat, DatasetName::Random, Some(8), 4.0)
        );
        assert_eq!(a.lengths(), Lengths { input: 100, output: 20 });
        assert_eq!(a.metrics().unwrap(), vec![Metric::Ttft, Metric::Tpot, Metric::Itl, Metric::E2el]);
        assert_eq!((a.percentiles().unwrap(), a.slos().unwrap().len()), (vec![50.0, 90.0, 99.0], 2));
        assert_eq!(a.extra_body().unwrap()["temperature"], serde_json::json!(0.0));
        a.validate().unwrap();
        let d = parse("");
        assert_eq!(
            (d.max_concurrency, d.request_rate.is_infinite(), d.lengths()),
            (None, true, Lengths { input: 1024, output: 128 })
        );
        assert_eq!(
            (d.num_prompts, d.metric_percentiles.as_str(), d.percentile_metrics.as_str()),
            (1000, "99", "ttft,tpot,itl")
        );
        assert!(d.ignore_eos() && d.extra_body().unwrap().is_empty());
        let p = parse(
            "--dataset-name prefix_repetition --prefix-repetition-prefix-len 10 --prefix-repetition-suffix-len 5",
        );
        assert_eq!((p.ignore_eos(), p.lengths()), (false, Lengths { input: 5, output: 128 }));
        assert_eq!(parse("--backend vllm").backend, Backend::Openai);
    }

    #[test]
    fn earlier_mla_bench_spellings_still_parse() {
        // As scripts/gpu_run.sh and the recorded runs wrote them.
        let a = parse("--base-url http://127.0.0.1:8011 --input-len 1024 --output-len 256 --num-prompts 12 --max-concurrency 1 --ignore-eos --gpu H200 --out o.json");
        assert_eq!((a.lengths(), a.gpu.as_str()), (Lengths { input: 1024, output: 256 }, "H200"));
        let p = parse("--dataset prefix-repetition --num-prompts 1000 --prefix-len 2000 --input-len 200 --output-len 128 --num-prefixes 1");
        assert_eq!(
            (p.dataset_name, p.prefix_repetition_prefix_len, p.prefix_repetition_num_prefixes),
            (DatasetName::PrefixRepetition, 2000, 1)
        );
        assert_eq!(p.lengths(), Lengths { input: 200, output: 128 });
        let m = parse("--dataset multi-turn --num-turns 8 --input-len 512 --output-len 128 --token-id-range 100..200");
        assert_eq!((m.dataset_name, m.num_turns, m.lengths().input), (DatasetName::MultiTurn, 8, 512));
        assert_eq!(parse("--dataset file --dataset-path p.jsonl").dataset_name, DatasetName::File);
    }

    #[test]
    fn bad_combinations_fail_before_any_request() {
        assert!(parse("--dataset-path x.json").validate().is_err());
        assert!(parse("--dataset-name sharegpt").validate().is_err());
        assert!(parse("--max-concurrency 0").validate().is_err());
        assert!(parse("--percentile-metrics ttft,latency").validate().is_err());
        assert!(parse("--metric-percentiles 99,abc").validate().is_err());
        assert!(parse("--goodput ttft=200").validate().is_err());
        assert!(parse("--header novalue").validate().is_err());
        assert!(parse("--extra-body [1]").validate().is_err());
        assert!(parse("--backend openai-chat --dataset-name multi-turn").validate().is_err());
        assert_eq!(key_values("metadata", &["tp=1".into()]).unwrap(), vec![("tp".to_string(), "1".to_string())]);
    }
}
