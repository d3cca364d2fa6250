//! `/metrics` scraped from the real router and engine: it parses as Prometheus exposition,
//! carries vLLM's series, counts each request once by its finish reason whatever its `n`, and
//! has every series the Grafana dashboard in `docs/grafana` queries.

use crate::common;
use crate::prometheus;

use common::{server, wait_idle, workspace_root, Options, TestServer};
use prometheus::Scrape;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;

async fn scrape(s: &TestServer) -> Scrape {
    let r = s.call("GET", "/metrics", None, &[]).await;
    assert_eq!(r.status, 200);
    assert!(r.content_type.starts_with("text/plain"), "{}", r.content_type);
    prometheus::parse(&r.text).unwrap_or_else(|e| panic!("{e}\n{}", r.text))
}

/// Sends requests of every kind: n > 1, several prompts, a stop string, streaming, chat.
async fn traffic(s: &TestServer) {
    let bodies = [
        ("/v1/completions", json!({"prompt": "x", "n": 3, "max_tokens": 4, "ignore_eos": true})),
        ("/v1/completions", json!({"prompt": ["a", "b"], "n": 2, "max_tokens": 3, "stream": true})),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "stop": "STOP"})),
    ];
    for (path, body) in bodies {
        let r = s.post(path, body).await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    wait_idle(s).await;
}

#[tokio::test]
async fn the_scrape_is_valid_exposition_with_vllms_series() {
    let s = server(Options { delay: Duration::from_millis(2), ..Options::default() });
    let empty = scrape(&s).await;
    traffic(&s).await;
    let busy = scrape(&s).await;
    for m in [&empty, &busy] {
        for f in &m.families {
            assert!(f.name.starts_with("mla:"), "{}", f.name);
            assert!(!f.help.trim().is_empty(), "{} has no help text", f.name);
            assert!(f.samples.iter().all(|x| x.labels.get("model_name").map(String::as_str) == Some("demo")));
        }
    }
    // vLLM's series (by their vLLM name, prefix aside) and type, each present.
    for (name, kind) in [
        ("num_requests_running", "gauge"),
        ("num_requests_waiting", "gauge"),
        ("kv_cache_usage_perc", "gauge"),
        ("gpu_cache_usage_perc", "gauge"),
        ("prompt_tokens_total", "counter"),
        ("generation_tokens_total", "counter"),
        ("num_preemptions_total", "counter"),
        ("prefix_cache_queries_total", "counter"),
        ("prefix_cache_hits_total", "counter"),
        ("request_success_total", "counter"),
        ("time_to_first_token_seconds", "histogram"),
        ("inter_token_latency_seconds", "histogram"),
        ("time_per_output_token_seconds", "histogram"),
        ("request_time_per_output_token_seconds", "histogram"),
        ("e2e_request_latency_seconds", "histogram"),
        ("request_queue_time_seconds", "histogram"),
        ("request_inference_time_seconds", "histogram"),
        ("request_prefill_time_seconds", "histogram"),
        ("request_decode_time_seconds", "histogram"),
        ("request_prompt_tokens", "histogram"),
        ("request_generation_tokens", "histogram"),
        ("request_max_num_generation_tokens", "histogram"),
        ("request_params_n", "histogram"),
        ("request_params_max_tokens", "histogram"),
        ("iteration_tokens_total", "histogram"),
    ] {
        let f = busy.family(&format!("mla:{name}")).unwrap_or_else(|| panic!("no mla:{name}"));
        assert_eq!(f.kind, kind, "{name}");
    }
    // The traffic left something in every request histogram (four engine requests finished).
    for name in ["e2e_request_latency_seconds", "request_prefill_time_seconds", "request_prompt_tokens"] {
        assert_eq!(busy.value(&format!("mla:{name}_count"), &[]), 4.0, "{name}");
    }
    assert!(busy.value("mla:iteration_tokens_total_count", &[]) > 0.0);
    assert_eq!(
        busy.value("mla:prompt_tokens_total", &[]),
        busy.value("mla:request_prompt_tokens_sum", &[]),
        "every prompt token belongs to a finished request"
    );
}

/// Which finish reasons moved between two scrapes, and by how much.
fn success_delta(series: &str, before: &Scrape, after: &Scrape) -> [f64; 3] {
    ["stop", "length", "abort"]
        .map(|r| after.value(series, &[("finished_reason", r)]) - before.value(series, &[("finished_reason", r)]))
}

#[tokio::test]
async fn request_success_counts_a_request_once_whatever_its_n() {
    // Steps take a few milliseconds, as on a GPU, so the server reads each stop-completing token
    // long before the engine would reach max_tokens.
    let s = server(Options { delay: Duration::from_millis(5), ..Options::default() });
    let mut before = scrape(&s).await;
    let cases = [
        // n=3, each completion reaching max_tokens: one request, ended by length.
        ("/v1/completions", json!({"prompt": "x", "n": 3, "max_tokens": 4, "ignore_eos": true}), [0.0, 1.0, 0.0]),
        // n=3, streamed chat, each completion ending on the stop string: one request, stop.
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 40, "stop": "STOP",
                   "ignore_eos": true, "stream": true}),
            [1.0, 0.0, 0.0],
        ),
        // Two prompts of n=3: two engine requests.
        (
            "/v1/completions",
            json!({"prompt": ["a", "b"], "n": 3, "max_tokens": 2, "ignore_eos": true}),
            [0.0, 2.0, 0.0],
        ),
    ];
    for (path, body, expected) in cases {
        let r = s.post(path, body.clone()).await;
        assert_eq!(r.status, 200, "{}", r.text);
        wait_idle(&s).await;
        let after = scrape(&s).await;
        assert_eq!(success_delta("mla:request_success_total", &before, &after), expected, "{body}");
        let prompts = expected.iter().sum::<f64>();
        assert_eq!(
            success_delta("mla:completion_success_total", &before, &after).iter().sum::<f64>(),
            3.0 * prompts,
            "{body}"
        );
        let delta = |name: &str| after.value(name, &[]) - before.value(name, &[]);
        assert_eq!(delta("mla:request_params_n_sum"), 3.0 * prompts);
        assert_eq!(delta("mla:e2e_request_latency_seconds_count"), prompts);
        assert_eq!(delta("mla:request_generation_tokens_sum"), delta("mla:generation_tokens_total"));
        before = after;
    }
    // The first request: 3 completions of 4 tokens, the longest 4.
    let s = server(Options::default());
    s.post("/v1/completions", json!({"prompt": "x", "n": 3, "max_tokens": 4, "ignore_eos": true})).await;
    wait_idle(&s).await;
    let m = scrape(&s).await;
    assert_eq!(m.value("mla:request_generation_tokens_sum", &[]), 12.0);
    assert_eq!(m.value("mla:request_max_num_generation_tokens_sum", &[]), 4.0);
    assert_eq!(m.value("mla:request_params_max_tokens_sum", &[]), 4.0);
    assert_eq!(m.value("mla:request_time_per_output_token_seconds_count", &[]), 1.0);
}

/// Every `expr` of the dashboard (and its variables' queries).
fn dashboard_queries(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, x) in map {
                match (k.as_str(), x) {
                    ("expr", Value::String(q)) => out.push(q.clone()),
                    ("query", Value::String(q)) if q.contains("label_values") => out.push(q.clone()),
                    _ => dashboard_queries(x, out),
                }
            }
        }
        Value::Array(xs) => xs.iter().for_each(|x| dashboard_queries(x, out)),
        _ => {}
    }
}

/// The series (identifiers with a colon: label names cannot have one) and the label names
/// (before a matcher inside braces, or listed after `by` / `without`) a PromQL query uses.
/// Grafana's `$variables`, strings and numbers with units (`5m`) are skipped.
fn names_in_query(q: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut series, mut labels) = (BTreeSet::new(), BTreeSet::new());
    let chars: Vec<char> = q.chars().collect();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let (mut i, mut braces, mut grouping, mut after_by) = (0, 0, false, false);
    while i < chars.len() {
        let c = chars[i];
        if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c == '$' || c.is_ascii_digit() {
            i += 1;
            while i < chars.len() && (ident(chars[i]) || chars[i] == '.') {
                i += 1;
            }
        } else if ident(c) {
            let start = i;
            while i < chars.len() && ident(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars[i..].iter().find(|c| !c.is_whitespace()).copied();
            if word.contains(':') {
                series.insert(word);
            } else if grouping || (braces > 0 && matches!(next, Some('=') | Some('!'))) {
                labels.insert(word);
            } else if ["by", "without", "on", "ignoring", "group_left", "group_right"].contains(&word.as_str()) {
                after_by = next == Some('(');
            }
        } else {
            match c {
                '{' => braces += 1,
                '}' => braces -= 1,
                '(' if after_by => (grouping, after_by) = (true, false),
                ')' => grouping = false,
                _ => {}
            }
            i += 1;
        }
    }
    (series, labels)
}

#[test]
fn the_query_reader_finds_series_and_labels() {
    let q = "histogram_quantile(0.99, sum by (le, model_name) (rate(mla:ttft_bucket{model_name=~\"$model_name\", \
             finished_reason!=\"a:b\"}[5m]))) / on() group_left sum(mla:x_total) > 1e-3 $__rate_interval";
    let (series, labels) = names_in_query(q);
    assert_eq!(series, BTreeSet::from(["mla:ttft_bucket".to_string(), "mla:x_total".to_string()]));
    assert_eq!(labels, BTreeSet::from(["le", "model_name", "finished_reason"].map(String::from)));
}

#[tokio::test]
async fn every_series_the_grafana_dashboard_queries_exists() {
    let path = workspace_root().join("docs/grafana/mla-serve.json");
    let dashboard: Value = common::read_json(&path);
    let mut queries = vec![];
    dashboard_queries(&dashboard, &mut queries);
    assert!(queries.len() >= 10, "only {} queries in {}", queries.len(), path.display());

    let s = server(Options::default());
    traffic(&s).await;
    let m = scrape(&s).await;
    let (exposed, exposed_labels) = (m.sample_names(), m.label_names());
    for q in &queries {
        let (series, labels) = names_in_query(q);
        assert!(!series.is_empty(), "a query with no mla: series: {q}");
        for name in &series {
            assert!(exposed.contains(name.as_str()), "the dashboard queries {name}, which /metrics lacks: {q}");
        }
        for label in &labels {
            assert!(
                exposed_labels.contains(label.as_str()),
                "the dashboard uses label {label}, which no series has: {q}"
            );
        }
    }

    // Importable: a Prometheus datasource variable that every panel uses, unique panel ids.
    let variables = dashboard["templating"]["list"].as_array().expect("templating variables");
    let datasource = variables
        .iter()
        .find(|v| v["type"] == "datasource" && v["query"] == "prometheus")
        .expect("a Prometheus datasource variable");
    let uid = format!("${{{}}}", datasource["name"].as_str().unwrap());
    let panels: Vec<&Value> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| std::iter::once(p).chain(p["panels"].as_array().into_iter().flatten()))
        .filter(|p| p["type"] != "row")
        .collect();
    assert!(panels.len() >= 8);
    let mut ids = BTreeSet::new();
    for p in &panels {
        assert!(ids.insert(p["id"].as_u64().expect("panel id")), "panel id {} twice", p["id"]);
        assert_eq!(p["datasource"]["uid"], uid.as_str(), "panel {}", p["title"]);
        for t in p["targets"].as_array().expect("targets") {
            assert_eq!(t["datasource"]["uid"], uid.as_str(), "panel {}", p["title"]);
        }
    }
}
