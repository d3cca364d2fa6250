//! `mla-bench serve`: a load generator for any OpenAI-compatible server that takes
//! `vllm bench serve`'s flags, draws its datasets the same way, computes its metrics with the
//! same definitions, prints the same table and writes the same result file, so either client
//! can measure either server. The steps: find the model, the tokenizer and the vocabulary;
//! draw the prompts; send one test request (it fails fast); time the run; report.

pub mod args;
mod arrivals;
mod client;
mod dataset;
mod load;
pub mod metrics;
mod request;
mod result;
mod server_info;
mod sharegpt;
mod sse;
mod table;
mod tls;
mod tokenizer;
mod vocab;

pub use args::ServeArgs;

use crate::report;
use args::DatasetName;
use dataset::Prompt;
use rand::{Rng, SeedableRng};
use request::{Backend, RequestSpec};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokenizer::BenchTokenizer;
use vocab::TokenPool;

/// What the run sends: independent prompts, or multi-turn conversations (new ids per turn).
enum Work {
    Prompts(Vec<Prompt>),
    Conversations(Vec<Vec<Vec<u32>>>),
}

pub fn main(a: ServeArgs) -> anyhow::Result<()> {
    a.validate()?;
    let target = match &a.base_url {
        Some(url) => client::Target::parse(url)?,
        None => client::Target::from_host_port(&a.host, a.port),
    };
    let endpoint = a.endpoint.clone().unwrap_or_else(|| a.backend.default_endpoint().to_string());
    a.backend.check_endpoint(&endpoint)?;
    let client = client::Client::new(target, a.insecure, args::key_values("header", &a.header)?)?;
    let files = mla_core::runtime::fd_limit::raise();
    if let Some(n) = files.filter(|&n| a.max_concurrency.unwrap_or(a.num_prompts) as u64 + 64 > n) {
        eprintln!("warning: {n} open files at most; some of the requests in flight may fail to connect");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(run(a, client, endpoint))
}

async fn run(a: ServeArgs, client: Arc<client::Client>, endpoint: String) -> anyhow::Result<()> {
    let card = server_info::model(&client, a.model.as_deref()).await?;
    let model_id = a.model.clone().unwrap_or_else(|| card.root.clone());
    let model_name = a.served_model_name.clone().unwrap_or_else(|| card.id.clone());
    eprintln!("Model: {model_name} ({})", client.target.url(&endpoint));
    let tokenizer = load_tokenizer(&a, &model_id)?;

    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    let work = dataset(&a, &client, &card, tokenizer.as_ref(), &mut rng).await?;
    let spec = Arc::new(RequestSpec {
        backend: a.backend,
        endpoint,
        model: model_name,
        ignore_eos: a.ignore_eos(),
        extra_body: a.extra_body()?,
    });
    // Random per run, as vLLM's uuid-based default, so two runs never share request ids.
    let prefix = a.request_id_prefix.clone().unwrap_or_else(|| format!("bench-{:08x}-", rand::rng().random::<u32>()));
    let load =
        load::Load { client: client.clone(), spec, max_concurrency: a.max_concurrency, request_id_prefix: prefix };

    let lengths = a.lengths();
    let (first, want_ids) = match &work {
        Work::Prompts(p) => (p.first().cloned().ok_or_else(|| anyhow::anyhow!("the dataset gave no prompts"))?, false),
        Work::Conversations(c) => {
            let ids = c.first().and_then(|c| c.first()).cloned().unwrap_or_default();
            (Prompt { prompt_len: ids.len(), prompt: json!(ids), output_len: lengths.output }, true)
        }
    };
    eprintln!("Starting initial single prompt test run...");
    load.initial_test(&first, want_ids, Duration::from_secs(a.ready_check_timeout_sec)).await?;
    eprintln!("Initial test run completed.");
    if a.num_warmups > 0 {
        eprintln!("Warming up with {} requests...", a.num_warmups);
        load.warm_up(&first, a.num_warmups).await;
    }

    let distribution = if a.burstiness == 1.0 { "Poisson process" } else { "Gamma distribution" };
    eprintln!("Starting main benchmark run...");
    eprintln!("Traffic request rate: {}", result::py_float(a.request_rate));
    eprintln!("Burstiness factor: {} ({distribution})", result::py_float(a.burstiness));
    eprintln!("Maximum request concurrency: {}", a.max_concurrency.map_or("None".to_string(), |c| c.to_string()));
    let (records, duration) = match work {
        Work::Prompts(prompts) => {
            let times = arrivals::schedule(prompts.len(), a.request_rate, a.burstiness, &mut rng)?;
            load.run(prompts, &times).await
        }
        Work::Conversations(c) => load.run_conversations(c, lengths.output, a.turn_delay, a.seed).await,
    };
    report_run(&a, &model_id, tokenizer.as_ref(), &client.target.url(""), &records, duration)
}

/// `--tokenizer`, else the model id where it names a local tokenizer (vLLM loads the model's
/// tokenizer by default; without a download there may be none, which only some datasets need).
fn load_tokenizer(a: &ServeArgs, model_id: &str) -> anyhow::Result<Option<BenchTokenizer>> {
    if a.skip_tokenizer_init {
        return Ok(None);
    }
    let spec = a.tokenizer.as_deref().unwrap_or(model_id);
    match tokenizer::locate(spec) {
        Some(path) => {
            let t = BenchTokenizer::load(&path)?;
            eprintln!("Tokenizer: {}", t.path.display());
            Ok(Some(t))
        }
        None if a.tokenizer.is_some() => {
            anyhow::bail!("--tokenizer {spec}: no tokenizer.json there or in the local HF cache")
        }
        None => Ok(None),
    }
}

/// Where random ids come from (see `vocab`).
async fn token_pool(
    a: &ServeArgs,
    client: &client::Client,
    card: &server_info::ModelCard,
    tok: Option<&BenchTokenizer>,
) -> anyhow::Result<TokenPool> {
    let pool = if let Some(r) = &a.token_id_range {
        vocab::parse_range(r)?
    } else if let Some(p) = tok.and_then(|t| t.pool()) {
        p
    } else if let Some(n) = server_info::vocab_size(client, card).await {
        vocab::pool_of_size(n)
    } else {
        eprintln!(
            "warning: the vocabulary size is unknown (no tokenizer, and the server does not say); random ids \
             come from {}..{} (--tokenizer or --token-id-range to set it)",
            vocab::FALLBACK.0,
            vocab::FALLBACK.1
        );
        TokenPool::range(vocab::FALLBACK.0, vocab::FALLBACK.1)
    };
    eprintln!("Random token ids from {}", pool.describe());
    Ok(pool)
}

async fn dataset(
    a: &ServeArgs,
    client: &client::Client,
    card: &server_info::ModelCard,
    tok: Option<&BenchTokenizer>,
    rng: &mut rand::rngs::StdRng,
) -> anyhow::Result<Work> {
    let len = a.lengths();
    let n = a.num_prompts;
    let need_tok = |what: &str| {
        tok.ok_or_else(|| anyhow::anyhow!("{what} needs the model's tokenizer: pass --tokenizer (a tokenizer.json, its directory or a cached HF repo id)"))
    };
    let prompts = match a.dataset_name {
        DatasetName::Sharegpt => {
            let path = a.dataset_path.as_deref().expect("validated");
            let o = sharegpt::Options {
                output_len: a.sharegpt_output_len.or(a.output_len),
                seed: a.seed,
                shuffle: !a.disable_shuffle,
                oversample: !a.no_oversample,
            };
            return Ok(Work::Prompts(sharegpt::load(path, n, need_tok("--dataset-name sharegpt")?, &o)?));
        }
        DatasetName::File => {
            return Ok(Work::Prompts(dataset::from_file(
                a.dataset_path.as_deref().expect("validated"),
                n,
                len.output,
            )?));
        }
        DatasetName::MultiTurn => {
            let pool = token_pool(a, client, card, tok).await?;
            return Ok(Work::Conversations(dataset::conversations(n, a.num_turns, len.input, &pool, a.seed)));
        }
        DatasetName::Random => {
            let pool = token_pool(a, client, card, tok).await?;
            let p =
                dataset::random(n, len.input, len.output, a.random_range_ratio, a.random_prefix_len, &pool, a.seed)?;
            (p, pool)
        }
        DatasetName::PrefixRepetition => {
            let pool = token_pool(a, client, card, tok).await?;
            let (prefix, num) = (a.prefix_repetition_prefix_len, a.prefix_repetition_num_prefixes);
            let p =
                dataset::prefix_repetition(n, prefix, len.input, num, len.output, &pool, a.seed, !a.disable_shuffle)?;
            (p, pool)
        }
    };
    let (mut prompts, pool) = prompts;
    if a.backend == Backend::OpenaiChat {
        // Chat messages are text: decode the ids, as vLLM builds its random prompts.
        let t = need_tok("--backend openai-chat with random token prompts")?;
        for p in &mut prompts {
            let ids: Vec<u32> = serde_json::from_value(p.prompt.take())?;
            let (text, len) = t.text_of(&ids, &pool, rng)?;
            (p.prompt, p.prompt_len) = (json!(text), len);
        }
    }
    Ok(Work::Prompts(prompts))
}

fn report_run(
    a: &ServeArgs,
    model_id: &str,
    tok: Option<&BenchTokenizer>,
    base_url: &str,
    records: &[metrics::RequestRecord],
    duration: Duration,
) -> anyhow::Result<()> {
    let failed: Vec<&str> = records.iter().filter_map(|r| r.error.as_deref()).collect();
    if !failed.is_empty() {
        eprintln!("Failed requests during benchmark run detected (capping to 10):");
        for (i, e) in failed.iter().take(10).enumerate() {
            eprintln!("Error {i}: {e}");
        }
    }
    let (percentiles, slos, selected) = (a.percentiles()?, a.slos()?, a.metrics()?);
    let m = metrics::calculate(records, duration.as_secs_f64(), &percentiles, &slos);
    let shown = table::Shown {
        max_concurrency: a.max_concurrency,
        request_rate: a.request_rate,
        goodput: !slos.is_empty(),
        metrics: &selected,
        percentiles: &percentiles,
    };
    println!("{}", table::table(&m, &shown));

    // vLLM's: the --tokenizer given, else the model id; none when no tokenizer was loaded.
    let tokenizer_id = tok.map(|_| a.tokenizer.clone().unwrap_or_else(|| model_id.to_string()));
    let metadata = args::key_values("metadata", &a.metadata)?;
    let reported = table::reported(&shown);
    let info = result::RunInfo {
        backend: a.backend.name(),
        label: a.label.as_deref(),
        model_id,
        tokenizer_id: tokenizer_id.as_deref(),
        num_prompts: a.num_prompts,
        request_rate: a.request_rate,
        burstiness: a.burstiness,
        max_concurrency: a.max_concurrency,
        metadata: &metadata,
        goodput: !slos.is_empty(),
        metrics: &reported,
        percentiles: &percentiles,
        detailed: a.save_detailed,
    };
    if a.save_result || a.append_result {
        let date = result::date_now();
        let path = result::file_name(&info, a.result_dir.as_deref(), a.result_filename.as_deref(), &date);
        result::save(&path, &result::build(&info, &m, records, &date), a.append_result)?;
    }
    if let Some(out) = &a.out {
        let len = a.lengths();
        let rate = if a.request_rate.is_finite() { json!(a.request_rate) } else { json!("inf") };
        let v = report::envelope(
            &a.gpu,
            json!({
                "base_url": base_url, "backend": a.backend.name(), "model": model_id, "dataset": a.dataset_name.name(),
                "input_len": len.input, "output_len": len.output, "prefix_len": a.prefix_repetition_prefix_len,
                "num_prefixes": a.prefix_repetition_num_prefixes, "num_turns": a.num_turns, "turn_delay": a.turn_delay, "num_prompts": a.num_prompts,
                "max_concurrency": a.max_concurrency, "request_rate": rate, "burstiness": a.burstiness,
                "ignore_eos": a.ignore_eos(), "temperature": a.temperature, "metrics": m,
            }),
        );
        report::write(Some(out), &v)?;
    }
    anyhow::ensure!(m.completed > 0, "every request failed ({} of {})", m.failed, records.len());
    Ok(())
}
