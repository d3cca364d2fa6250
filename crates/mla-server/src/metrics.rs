//! `/metrics`: vLLM's series, under vLLM's names and labels, with the prefix `mla:` where vLLM
//! has `vllm:`, or `vllm:` itself with `--metrics-prefix vllm`. One set of series under one
//! prefix, not a `vllm:` twin of each: a twin would double the cardinality of every scrape for
//! data that is already there. `docs/metrics.md` lists the series; `docs/grafana/mla-serve.json`
//! charts them.
//!
//! Where vLLM renamed a series, the older name is here too, with the same samples:
//! `gpu_cache_usage_perc` (now `kv_cache_usage_perc`) and `time_per_output_token_seconds` (now
//! `inter_token_latency_seconds`), so dashboards of either age work.
//!
//! Every number comes from one `EngineStats` snapshot. A request is one prompt with its `n`
//! completions: `request_success_total` and the `request_*` histograms count it once (vLLM v1
//! counts each of its completions), and `completion_success_total` counts the completions. The
//! server ends a completion on a stop string with `RequestStream::finish_choice(.., Stop)`, so
//! the engine counts it as a stop, and it counts a client that went away as aborted when it sees
//! the closed stream.
//!
//! Known limit: the engine keeps decoding while the server detokenizes, so if it ends a
//! completion by length before the server has read the token that completes a stop string (the
//! stop string lands in the last token or two, or the server lags several steps behind), the
//! client is told "stop" (as vLLM does) but the engine has already counted "length", and the
//! late `finish_choice` changes nothing.

mod exposition;

use exposition::Exposition;
use mla_engine::{EngineStats, FinishCounts, FinishReason, RankStats};

/// Reads one per-rank gauge from a rank's statistics.
type RankGauge = fn(&RankStats) -> f64;

/// What `/metrics` says besides the engine's numbers, fixed at startup.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsConfig {
    /// Every series is `<prefix>:<name>`: `mla` by default, `vllm` for dashboards that query
    /// vLLM's names unchanged (`--metrics-prefix`).
    pub prefix: String,
    /// vLLM's `cache_config_info` labels, in order (values as vLLM's Python `str()` writes them).
    pub cache_info: Vec<(&'static str, String)>,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig { prefix: "mla".into(), cache_info: vec![] }
    }
}

/// Renders the whole exposition for `model` (the served model name, a label on every sample),
/// with `open_connections` the HTTP connections held open now.
pub fn render(model: &str, config: &MetricsConfig, stats: &EngineStats, open_connections: usize) -> String {
    let mut e = Exposition::new(&config.prefix, model);
    cache_config(&mut e, config);
    e.gauge(
        "http_connections_open",
        "HTTP connections held open (within --max-connections; refused ones not counted).",
        open_connections as f64,
    );
    scheduler_state(&mut e, stats);
    per_rank(&mut e, stats);
    counters(&mut e, stats);
    latencies(&mut e, stats);
    request_sizes(&mut e, stats);
    e.into_text()
}

/// vLLM's info series: a gauge at 1 whose labels describe the KV cache.
fn cache_config(e: &mut Exposition, config: &MetricsConfig) {
    let labels = config
        .cache_info
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", exposition::escape_label(v)))
        .collect::<Vec<_>>()
        .join(",");
    e.labelled("cache_config_info", "Information of the KV cache configuration.", "gauge", [(labels, 1.0)]);
}

fn scheduler_state(e: &mut Exposition, s: &EngineStats) {
    e.gauge("num_requests_running", "Requests in the running batch.", s.running as f64);
    e.gauge("num_requests_waiting", "Requests waiting for admission.", s.waiting as f64);
    // vLLM splits the waiting by why they wait: every request here waits for room in the batch
    // or the cache ("capacity"); nothing defers one ("deferred": LoRA budgets, KV transfers).
    e.labelled(
        "num_requests_waiting_by_reason",
        "Waiting requests by reason: capacity (room in the batch or the KV cache) or deferred (never, here).",
        "gauge",
        [("reason=\"capacity\"".to_string(), s.waiting as f64), ("reason=\"deferred\"".to_string(), 0.0)],
    );
    e.gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", s.kv_usage);
    e.gauge(
        "gpu_cache_usage_perc",
        "Fraction of KV cache blocks in use (1 = full). vLLM's older name for kv_cache_usage_perc.",
        s.kv_usage,
    );
    e.gauge("kv_cache_capacity_tokens", "Tokens the KV cache holds in total.", s.kv_capacity_tokens as f64);
}

fn per_rank(e: &mut Exposition, s: &EngineStats) {
    e.gauge("num_attention_ranks", "Attention ranks (each with its own scheduler and KV cache).", s.ranks.len() as f64);
    let gauges: [(&str, &str, RankGauge); 4] = [
        ("rank_num_requests_running", "Requests in the running batch, per attention rank.", |r| r.running as f64),
        ("rank_num_requests_waiting", "Requests waiting for admission, per attention rank.", |r| r.waiting as f64),
        ("rank_kv_cache_usage_perc", "Fraction of the rank's KV cache blocks in use.", |r| r.kv_usage),
        ("rank_load_tokens", "Tokens the rank's live requests may hold at most (what the router balances).", |r| {
            r.load_tokens as f64
        }),
    ];
    for (name, help, value) in gauges {
        let samples = s.ranks.iter().enumerate().map(|(i, r)| (format!("rank=\"{i}\""), value(r)));
        e.labelled(name, help, "gauge", samples);
    }
    // Each rank's own hit rate (hits over queries): where routing sends a request shows here.
    let counters: [(&str, &str, RankGauge); 2] = [
        (
            "rank_prefix_cache_queries_total",
            "Prompt tokens looked up in the rank's prefix cache when their requests were admitted.",
            |r| r.prefix_cache_queries as f64,
        ),
        ("rank_prefix_cache_hits_total", "Prompt tokens found in the rank's prefix cache.", |r| {
            r.prefix_cache_hits as f64
        }),
    ];
    for (name, help, value) in counters {
        let samples = s.ranks.iter().enumerate().map(|(i, r)| (format!("rank=\"{i}\""), value(r)));
        e.labelled(name, help, "counter", samples);
    }
    let r = &s.routing;
    e.labelled(
        "router_decisions_total",
        "Requests routed to an attention rank, by reason: prefix (the rank caching the longest start of the \
         prompt), balance (the least-loaded rank, the prefix's rank having too much work), tie (the least-loaded \
         rank, no rank caching more than another), least_loaded (--router-policy least-loaded). None with one rank.",
        "counter",
        [("prefix", r.prefix), ("balance", r.balance), ("tie", r.tie), ("least_loaded", r.least_loaded)]
            .map(|(reason, n)| (format!("reason=\"{reason}\""), n as f64)),
    );
}

fn counters(e: &mut Exposition, s: &EngineStats) {
    e.counter("prompt_tokens_total", "Prompt tokens processed.", s.prompt_tokens_total);
    e.counter("generation_tokens_total", "Tokens generated.", s.generation_tokens_total);
    e.counter("num_preemptions_total", "Requests preempted because the KV cache ran out.", s.preemptions_total);
    e.counter(
        "prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache when their requests were admitted.",
        s.prefix_cache_queries,
    );
    e.counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits);
    e.counter("steps_total", "Forward steps run (a DP-attention group's step counts once).", s.steps.steps);
    e.counter(
        "mixed_steps_total",
        "Steps that held prompt chunks and decode rows together (off with --disable-mixed-chunk).",
        s.steps.mixed,
    );
    spec_decode(e, &s.spec);
    e.labelled(
        "request_success_total",
        "Requests finished, by finished_reason: abort if aborted or failed, else length if any of its \
         completions reached its limit, else stop. A request with n completions counts once.",
        "counter",
        by_reason(&s.requests.finished),
    );
    let completions = FinishCounts { stop: s.finished_stop, length: s.finished_length, abort: s.finished_abort };
    e.labelled(
        "completion_success_total",
        "Completions (choices) finished, by finished_reason.",
        "counter",
        by_reason(&completions),
    );
}

/// vLLM's speculative decoding counters (all zero without `--speculative-config`).
fn spec_decode(e: &mut Exposition, s: &mla_engine::scheduler::SpecStats) {
    e.counter("spec_decode_num_drafts_total", "Decode rows that fed drafts for verification.", s.drafts);
    e.counter("spec_decode_num_draft_tokens_total", "Drafted tokens fed for verification.", s.draft_tokens);
    e.counter("spec_decode_num_accepted_tokens_total", "Drafted tokens that verification accepted.", s.accepted_tokens);
    e.labelled(
        "spec_decode_num_accepted_tokens_per_pos_total",
        "Drafted tokens accepted, by their position among a step's drafts (0 first).",
        "counter",
        s.accepted_per_pos
            .iter()
            .enumerate()
            .map(|(p, &n)| (format!("position=\"{p}\""), n as f64))
            .collect::<Vec<_>>(),
    );
}

fn by_reason(counts: &FinishCounts) -> Vec<(String, f64)> {
    [FinishReason::Stop, FinishReason::Length, FinishReason::Abort]
        .into_iter()
        .map(|r| (format!("finished_reason=\"{}\"", r.as_str()), counts.get(r) as f64))
        .collect()
}

fn latencies(e: &mut Exposition, s: &EngineStats) {
    let r = &s.requests;
    let itl = "Time between consecutive tokens of a completion.";
    for (name, help, h) in [
        ("time_to_first_token_seconds", "Time from arrival to the first generated token.", &s.time_to_first_token),
        ("inter_token_latency_seconds", itl, &s.inter_token_latency),
        (
            "time_per_output_token_seconds",
            "Time between consecutive tokens of a completion. vLLM's older name for \
             mla:inter_token_latency_seconds.",
            &s.inter_token_latency,
        ),
        (
            "request_time_per_output_token_seconds",
            "Per request: decode time over the tokens after the first (of its longest completion).",
            &r.time_per_output_token,
        ),
        ("e2e_request_latency_seconds", "Time from arrival to the last token, per request.", &s.e2e_latency),
        ("request_queue_time_seconds", "Time from arrival to first scheduling, per request.", &s.queue_time),
        (
            "request_inference_time_seconds",
            "Time from first scheduling to the last token (prefill and decode), per request.",
            &r.inference_time,
        ),
        (
            "request_prefill_time_seconds",
            "Time from first scheduling to the first token, per request.",
            &r.prefill_time,
        ),
        ("request_decode_time_seconds", "Time from the first token to the last, per request.", &r.decode_time),
    ] {
        e.histogram(name, help, h);
    }
}

fn request_sizes(e: &mut Exposition, s: &EngineStats) {
    let r = &s.requests;
    for (name, help, h) in [
        ("request_prompt_tokens", "Prompt tokens per request.", &r.prompt_tokens),
        (
            "request_generation_tokens",
            "Tokens generated per request, all its completions together.",
            &r.generation_tokens,
        ),
        (
            "request_max_num_generation_tokens",
            "Tokens of the longest completion, per request.",
            &r.max_generation_tokens,
        ),
        ("request_params_n", "The n parameter (completions) per request.", &r.params_n),
        ("request_params_max_tokens", "The max_tokens parameter per request.", &r.params_max_tokens),
        (
            "iteration_tokens_total",
            "Tokens of one engine step on an attention rank, as vLLM counts them: prompt tokens computed plus tokens sampled.",
            &s.iteration_tokens,
        ),
    ] {
        e.histogram(name, help, h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mla_engine::{Histogram, RequestStats};

    fn lines(text: &str, prefix: &str) -> Vec<String> {
        text.lines().filter(|l| l.starts_with(prefix)).map(String::from).collect()
    }

    #[test]
    fn gauges_counters_and_reasons() {
        let stats = EngineStats {
            running: 3,
            waiting: 2,
            kv_usage: 0.25,
            kv_capacity_tokens: 4096,
            prompt_tokens_total: 120,
            generation_tokens_total: 45,
            preemptions_total: 1,
            prefix_cache_queries: 300,
            prefix_cache_hits: 128,
            finished_stop: 5,
            finished_length: 0,
            finished_abort: 1,
            requests: RequestStats { finished: FinishCounts { stop: 2, length: 0, abort: 1 }, ..RequestStats::new(16) },
            ..Default::default()
        };
        let text = render("demo", &MetricsConfig::default(), &stats, 0);
        assert!(
            text.contains("# TYPE mla:num_requests_running gauge\nmla:num_requests_running{model_name=\"demo\"} 3\n")
        );
        assert!(text.contains("mla:num_requests_waiting{model_name=\"demo\"} 2\n"));
        assert!(text.contains("mla:kv_cache_usage_perc{model_name=\"demo\"} 0.25\n"));
        assert!(text.contains("mla:gpu_cache_usage_perc{model_name=\"demo\"} 0.25\n"));
        assert!(
            text.contains("# TYPE mla:prompt_tokens_total counter\nmla:prompt_tokens_total{model_name=\"demo\"} 120\n")
        );
        assert!(text.contains("mla:generation_tokens_total{model_name=\"demo\"} 45\n"));
        assert!(text.contains("mla:num_preemptions_total{model_name=\"demo\"} 1\n"));
        assert!(text.contains("mla:prefix_cache_queries_total{model_name=\"demo\"} 300\n"));
        assert!(text.contains("mla:prefix_cache_hits_total{model_name=\"demo\"} 128\n"));
        assert_eq!(
            lines(&text, "mla:request_success_total"),
            vec![
                "mla:request_success_total{model_name=\"demo\",finished_reason=\"stop\"} 2",
                "mla:request_success_total{model_name=\"demo\",finished_reason=\"length\"} 0",
                "mla:request_success_total{model_name=\"demo\",finished_reason=\"abort\"} 1",
            ]
        );
        assert_eq!(
            lines(&text, "mla:completion_success_total{model_name=\"demo\",finished_reason=\"stop\"}"),
            vec!["mla:completion_success_total{model_name=\"demo\",finished_reason=\"stop\"} 5"]
        );
    }

    #[test]
    fn every_histogram_is_declared_once_and_aliases_repeat_the_samples() {
        let mut itl = Histogram::with_bounds(&[0.01, 0.1]);
        itl.observe(0.05);
        let stats = EngineStats { inter_token_latency: itl, requests: RequestStats::new(64), ..Default::default() };
        let text = render("m", &MetricsConfig::default(), &stats, 0);
        for name in [
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "time_per_output_token_seconds",
            "request_time_per_output_token_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_inference_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_prompt_tokens",
            "request_generation_tokens",
            "request_max_num_generation_tokens",
            "request_params_n",
            "request_params_max_tokens",
            "iteration_tokens_total",
        ] {
            assert_eq!(text.matches(&format!("# TYPE mla:{name} histogram\n")).count(), 1, "{name}");
        }
        let samples = |name: &str| -> Vec<String> {
            lines(&text, name).into_iter().map(|l| l[name.len()..].to_string()).collect()
        };
        assert_eq!(samples("mla:inter_token_latency_seconds"), samples("mla:time_per_output_token_seconds"));
        assert_eq!(samples("mla:inter_token_latency_seconds").len(), 5);
    }

    #[test]
    fn the_prefix_names_every_series_and_cache_info_carries_its_labels() {
        let config = MetricsConfig {
            prefix: "vllm".into(),
            cache_info: vec![("block_size", "64".into()), ("enable_prefix_caching", "True".into())],
        };
        let text =
            render("m", &config, &EngineStats { waiting: 3, requests: RequestStats::new(16), ..Default::default() }, 0);
        let names: Vec<&str> =
            text.lines().filter(|l| !l.starts_with('#')).map(|l| l.split(['{', ' ']).next().unwrap()).collect();
        assert!(names.iter().all(|n| n.starts_with("vllm:")), "{names:?}");
        assert!(text
            .contains("vllm:cache_config_info{model_name=\"m\",block_size=\"64\",enable_prefix_caching=\"True\"} 1\n"));
        assert!(text.contains("vllm:num_requests_waiting_by_reason{model_name=\"m\",reason=\"capacity\"} 3\n"));
        assert!(text.contains("vllm:num_requests_waiting_by_reason{model_name=\"m\",reason=\"deferred\"} 0\n"));
    }

    #[test]
    fn per_rank_gauges_carry_a_rank_label() {
        let ranks = vec![
            RankStats {
                running: 4,
                waiting: 1,
                kv_usage: 0.5,
                kv_capacity_tokens: 64,
                load_tokens: 900,
                prefix_cache_queries: 400,
                prefix_cache_hits: 256,
            },
            RankStats {
                running: 2,
                waiting: 0,
                kv_usage: 0.125,
                kv_capacity_tokens: 64,
                load_tokens: 300,
                ..Default::default()
            },
        ];
        let routing = mla_engine::RoutingStats { prefix: 7, balance: 2, tie: 3, least_loaded: 0 };
        let text = render("m", &MetricsConfig::default(), &EngineStats { ranks, routing, ..Default::default() }, 0);
        assert!(text.contains("mla:num_attention_ranks{model_name=\"m\"} 2\n"));
        assert_eq!(
            lines(&text, "mla:rank_load_tokens"),
            vec![
                "mla:rank_load_tokens{model_name=\"m\",rank=\"0\"} 900",
                "mla:rank_load_tokens{model_name=\"m\",rank=\"1\"} 300"
            ]
        );
        assert!(text.contains("mla:rank_num_requests_running{model_name=\"m\",rank=\"1\"} 2\n"));
        assert!(text.contains("mla:rank_kv_cache_usage_perc{model_name=\"m\",rank=\"0\"} 0.5\n"));
        assert!(text.contains("# TYPE mla:rank_prefix_cache_hits_total counter\n"));
        assert!(text.contains("mla:rank_prefix_cache_queries_total{model_name=\"m\",rank=\"0\"} 400\n"));
        assert!(text.contains("mla:rank_prefix_cache_hits_total{model_name=\"m\",rank=\"0\"} 256\n"));
        assert!(text.contains("mla:rank_prefix_cache_hits_total{model_name=\"m\",rank=\"1\"} 0\n"));
        assert_eq!(
            lines(&text, "mla:router_decisions_total"),
            vec![
                "mla:router_decisions_total{model_name=\"m\",reason=\"prefix\"} 7",
                "mla:router_decisions_total{model_name=\"m\",reason=\"balance\"} 2",
                "mla:router_decisions_total{model_name=\"m\",reason=\"tie\"} 3",
                "mla:router_decisions_total{model_name=\"m\",reason=\"least_loaded\"} 0",
            ]
        );
    }
}
