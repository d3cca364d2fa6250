//! The result file of `--save-result`, with the fields and names `vllm bench serve` writes
//! (vllm/benchmarks/serve.py, `main_async` and `benchmark`), so tools that read vLLM's results
//! read these: the run's setup, the totals, per-request lists with `--save-detailed`, and
//! mean/median/std/percentiles of each reported metric in ms.

use super::metrics::{percentile_word, Metric, RequestRecord, ServeMetrics};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

pub struct RunInfo<'a> {
    pub backend: &'a str,
    pub label: Option<&'a str>,
    pub model_id: &'a str,
    pub tokenizer_id: Option<&'a str>,
    pub num_prompts: usize,
    pub request_rate: f64,
    pub burstiness: f64,
    pub max_concurrency: Option<usize>,
    /// `--metadata KEY=VALUE` pairs, written as top-level fields.
    pub metadata: &'a [(String, String)],
    pub goodput: bool,
    /// The metrics the table reports (`table::reported`).
    pub metrics: &'a [Metric],
    pub percentiles: &'a [f64],
    pub detailed: bool,
}

/// A float as Python's `str` writes it (`inf`, `10.0`, `0.5`): the file name, the log lines.
pub fn py_float(x: f64) -> String {
    if x.is_infinite() {
        "inf".into()
    } else if x.fract() == 0.0 && x.abs() < 1e16 {
        format!("{x:.1}")
    } else {
        format!("{x}")
    }
}

/// vLLM's `datetime.now().strftime("%Y%m%d-%H%M%S")`, local time.
pub fn date_now() -> String {
    chrono::Local::now().format("%Y%m%d-%H%M%S").to_string()
}

pub fn build(info: &RunInfo, m: &ServeMetrics, records: &[RequestRecord], date: &str) -> Map<String, Value> {
    let mut r = Map::new();
    let mut put = |k: &str, v: Value| {
        r.insert(k.to_string(), v);
    };
    put("date", json!(date));
    put("endpoint_type", json!(info.backend));
    put("backend", json!(info.backend));
    put("label", json!(info.label));
    put("model_id", json!(info.model_id));
    put("tokenizer_id", json!(info.tokenizer_id));
    put("num_prompts", json!(info.num_prompts));
    for (k, v) in info.metadata {
        put(k, json!(v));
    }
    put("request_rate", if info.request_rate.is_finite() { json!(info.request_rate) } else { json!("inf") });
    put("burstiness", json!(info.burstiness));
    put("max_concurrency", json!(info.max_concurrency));
    put("duration", json!(m.duration_s));
    put("completed", json!(m.completed));
    put("failed", json!(m.failed));
    put("total_input_tokens", json!(m.total_input_tokens));
    put("total_output_tokens", json!(m.total_output_tokens));
    put("request_throughput", json!(m.request_throughput));
    put("request_goodput", json!(m.request_goodput.filter(|_| info.goodput)));
    put("output_throughput", json!(m.output_throughput));
    put("total_token_throughput", json!(m.total_token_throughput));
    if info.detailed {
        put("input_lens", records.iter().map(|x| x.prompt_tokens).collect());
        put("output_lens", json!(m.output_lens));
        put("ttfts", records.iter().map(|x| x.ttft).collect());
        put("itls", json!(records.iter().map(|x| &x.itl).collect::<Vec<_>>()));
        put("latencies", records.iter().map(|x| x.latency).collect());
        put("start_times", records.iter().map(|x| x.start).collect());
        put("queue_times", records.iter().map(|x| x.queue_time).collect());
        put("generated_texts", records.iter().map(|x| x.generated_text.as_str()).collect());
        put("errors", records.iter().map(|x| x.error.as_deref().unwrap_or("")).collect());
    }
    put("max_output_tokens_per_s", json!(m.max_output_tokens_per_s));
    put("max_concurrent_requests", json!(m.max_concurrent_requests));
    put("rtfx", json!(0.0));
    for &metric in info.metrics {
        let (k, st) = (metric.key(), m.stats(metric));
        put(&format!("mean_{k}_ms"), json!(st.mean_ms));
        put(&format!("median_{k}_ms"), json!(st.median_ms));
        put(&format!("std_{k}_ms"), json!(st.std_ms));
        for &p in info.percentiles {
            let word = percentile_word(p);
            put(&format!("p{word}_{k}_ms"), json!(st.percentiles[&format!("p{word}")]));
        }
    }
    r
}

/// vLLM's file name: `--result-filename`, else `{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`
/// (label defaulting to the backend, model its last path part), under `--result-dir` if given.
pub fn file_name(info: &RunInfo, result_dir: Option<&Path>, result_filename: Option<&str>, date: &str) -> PathBuf {
    let name = match result_filename {
        Some(f) => f.to_string(),
        None => {
            let label = info.label.unwrap_or(info.backend);
            let conc = info.max_concurrency.map(|c| format!("-concurrency{c}")).unwrap_or_default();
            let model = info.model_id.rsplit('/').next().unwrap_or(info.model_id);
            format!("{label}-{}qps{conc}-{model}-{date}.json", py_float(info.request_rate))
        }
    };
    match result_dir {
        Some(d) => d.join(name),
        None => PathBuf::from(name),
    }
}

/// Writes (or with `append`, appends as one more line) the result.
pub fn save(path: &Path, result: &Map<String, Value>, append: bool) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
    }
    let text = serde_json::to_string(result)?;
    let res = if append {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        let sep = if f.metadata()?.len() > 0 { "\n" } else { "" };
        write!(f, "{sep}{text}")
    } else {
        std::fs::write(path, text)
    };
    res.map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::metrics::calculate;

    fn info<'a>(metrics: &'a [Metric], detailed: bool) -> RunInfo<'a> {
        RunInfo {
            backend: "openai",
            label: None,
            model_id: "deepseek-ai/DeepSeek-V2-Lite",
            tokenizer_id: None,
            num_prompts: 2,
            request_rate: f64::INFINITY,
            burstiness: 1.0,
            max_concurrency: Some(4),
            metadata: &[],
            goodput: false,
            metrics,
            percentiles: &[99.0, 99.9],
            detailed,
        }
    }

    #[test]
    fn result_fields_are_vllms() {
        let ok = RequestRecord {
            success: true,
            prompt_tokens: 5,
            output_tokens: 2,
            ttft: 0.1,
            itl: vec![0.02],
            latency: 0.12,
            generated_text: "hi".into(),
            ..Default::default()
        };
        let failed = RequestRecord { prompt_tokens: 5, error: Some("HTTP 500".into()), ..Default::default() };
        let records = [ok, failed];
        let m = calculate(&records, 1.0, &[99.0, 99.9], &[]);
        let metrics = [Metric::Ttft, Metric::Itl];
        let r = build(&info(&metrics, true), &m, &records, "20261126-101500");
        for k in [
            "date",
            "endpoint_type",
            "backend",
            "label",
            "model_id",
            "tokenizer_id",
            "num_prompts",
            "request_rate",
            "burstiness",
            "max_concurrency",
            "duration",
            "completed",
            "failed",
            "total_input_tokens",
            "total_output_tokens",
            "request_throughput",
            "request_goodput",
            "output_throughput",
            "total_token_throughput",
            "input_lens",
            "output_lens",
            "ttfts",
            "itls",
            "latencies",
            "start_times",
            "queue_times",
            "generated_texts",
            "errors",
            "max_output_tokens_per_s",
            "max_concurrent_requests",
            "rtfx",
            "mean_ttft_ms",
            "median_ttft_ms",
            "std_ttft_ms",
            "p99_ttft_ms",
            "p99.9_ttft_ms",
            "mean_itl_ms",
            "p99.9_itl_ms",
        ] {
            assert!(r.contains_key(k), "{k} missing");
        }
        assert!(!r.contains_key("mean_tpot_ms"), "only the reported metrics");
        assert_eq!(
            (&r["request_rate"], &r["request_goodput"], &r["label"]),
            (&json!("inf"), &Value::Null, &Value::Null)
        );
        assert_eq!((&r["completed"], &r["failed"], &r["total_input_tokens"]), (&json!(1), &json!(1), &json!(5)));
        assert_eq!(r["output_lens"], json!([2, 0]));
        assert_eq!(r["errors"], json!(["", "HTTP 500"]));
        assert_eq!(r["itls"], json!([[0.02], []]));
        assert_eq!(r["generated_texts"], json!(["hi", ""]));
        assert!((r["mean_ttft_ms"].as_f64().unwrap() - 100.0).abs() < 1e-9);
        let brief = build(&info(&metrics, false), &m, &records, "d");
        assert!(!brief.contains_key("ttfts") && !brief.contains_key("errors") && brief.contains_key("p99_ttft_ms"));
    }

    #[test]
    fn file_names_are_vllms() {
        let i = info(&[], false);
        let d = "20261126-101500";
        assert_eq!(
            file_name(&i, None, None, d),
            PathBuf::from("openai-infqps-concurrency4-DeepSeek-V2-Lite-20261126-101500.json")
        );
        let i = RunInfo { request_rate: 10.0, max_concurrency: None, label: Some("mla"), ..i };
        assert_eq!(
            file_name(&i, Some(Path::new("out")), None, d),
            PathBuf::from("out/mla-10.0qps-DeepSeek-V2-Lite-20261126-101500.json")
        );
        assert_eq!(file_name(&i, Some(Path::new("out")), Some("r.json"), d), PathBuf::from("out/r.json"));
        assert_eq!((py_float(0.5), py_float(f64::INFINITY)), ("0.5".to_string(), "inf".to_string()));
    }

    #[test]
    fn append_adds_a_line() {
        let path = std::env::temp_dir().join(format!("mla-bench-append-{}/r.json", std::process::id()));
        let mut r = Map::new();
        r.insert("a".into(), json!(1));
        save(&path, &r, true).unwrap();
        save(&path, &r, true).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"a\":1}\n{\"a\":1}");
        save(&path, &r, false).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"a\":1}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
