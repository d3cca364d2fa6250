//! `/metrics`: Prometheus text exposition (format 0.0.4) with vLLM's series names under an `mla:`
//! prefix, so existing vLLM dashboards work after a prefix rename.
//!
//! Every number comes from one `EngineStats` snapshot, finished completions by reason included:
//! the server ends a choice on a stop string with `RequestStream::finish_choice(.., Stop)`, so the
//! engine counts it as a stop, and the engine counts a client that went away as aborted when it
//! sees the closed stream.
//!
//! Known limit: the engine keeps decoding while the server detokenizes, so if it ends a
//! completion by length before the server has read the token that completes a stop string (the
//! stop string lands in the last token or two, or the server lags several steps behind), the
//! client is told "stop" (as vLLM does) but the engine has already counted "length", and the
//! late `finish_choice` changes nothing.

use mla_engine::{EngineStats, FinishReason, Histogram, RankStats};
use std::fmt::Write;

/// Reads one per-rank gauge from a rank's statistics.
type RankGauge = fn(&RankStats) -> f64;

/// Renders the whole exposition for `model` (the served model name, a label on every sample).
pub fn render(model: &str, stats: &EngineStats) -> String {
    let label = format!("model_name=\"{}\"", escape_label(model));
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, value: f64| {
        family(&mut out, name, help, "gauge");
        sample(&mut out, name, &label, value);
    };
    gauge("mla:num_requests_running", "Requests in the running batch.", stats.running as f64);
    gauge("mla:num_requests_waiting", "Requests waiting for admission.", stats.waiting as f64);
    gauge("mla:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", stats.kv_usage);
    gauge("mla:kv_cache_capacity_tokens", "Tokens the KV cache holds in total.", stats.kv_capacity_tokens as f64);
    gauge(
        "mla:num_attention_ranks",
        "Attention ranks (each with its own scheduler and KV cache).",
        stats.ranks.len() as f64,
    );
    let per_rank: [(&str, &str, RankGauge); 4] = [
        ("mla:rank_num_requests_running", "Requests in the running batch, per attention rank.", |r| r.running as f64),
        ("mla:rank_num_requests_waiting", "Requests waiting for admission, per attention rank.", |r| r.waiting as f64),
        ("mla:rank_kv_cache_usage_perc", "Fraction of the rank's KV cache blocks in use.", |r| r.kv_usage),
        ("mla:rank_load_tokens", "Tokens the rank's live requests may hold at most (what the router balances).", |r| {
            r.load_tokens as f64
        }),
    ];
    for (name, help, value) in per_rank {
        family(&mut out, name, help, "gauge");
        for (i, r) in stats.ranks.iter().enumerate() {
            sample(&mut out, name, &format!("{label},rank=\"{i}\""), value(r));
        }
    }

    let mut counter = |name: &str, help: &str, value: u64| {
        family(&mut out, name, help, "counter");
        sample(&mut out, name, &label, value as f64);
    };
    counter("mla:prompt_tokens_total", "Prompt tokens processed.", stats.prompt_tokens_total);
    counter("mla:generation_tokens_total", "Tokens generated.", stats.generation_tokens_total);
    counter("mla:num_preemptions_total", "Requests preempted because the KV cache ran out.", stats.preemptions_total);
    counter(
        "mla:prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache when their requests were admitted.",
        stats.prefix_cache_queries,
    );
    counter("mla:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits);

    let name = "mla:request_success_total";
    family(&mut out, name, "Completions finished, by finish_reason.", "counter");
    for reason in [FinishReason::Stop, FinishReason::Length, FinishReason::Abort] {
        let l = format!("{label},finished_reason=\"{}\"", reason.as_str());
        let finished = match reason {
            FinishReason::Stop => stats.finished_stop,
            FinishReason::Length => stats.finished_length,
            FinishReason::Abort => stats.finished_abort,
        };
        sample(&mut out, name, &l, finished as f64);
    }

    let hists = [
        (
            "mla:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            &stats.time_to_first_token,
        ),
        ("mla:inter_token_latency_seconds", "Time between consecutive generated tokens.", &stats.inter_token_latency),
        ("mla:e2e_request_latency_seconds", "Time from arrival to the last token.", &stats.e2e_latency),
        ("mla:request_queue_time_seconds", "Time from arrival to first scheduling.", &stats.queue_time),
    ];
    for (name, help, h) in hists {
        histogram(&mut out, name, help, &label, h);
    }
    out
}

fn family(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, labels: &str, value: f64) {
    let _ = writeln!(out, "{name}{{{labels}}} {}", number(value));
}

/// Prometheus buckets are cumulative; the engine's counts are per bucket.
fn histogram(out: &mut String, name: &str, help: &str, label: &str, h: &Histogram) {
    family(out, name, help, "histogram");
    let mut cumulative = 0u64;
    for (bound, count) in h.bounds.iter().zip(&h.counts) {
        cumulative += count;
        let l = format!("{label},le=\"{}\"", number(*bound));
        sample(out, &format!("{name}_bucket"), &l, cumulative as f64);
    }
    sample(out, &format!("{name}_bucket"), &format!("{label},le=\"+Inf\""), h.count as f64);
    sample(out, &format!("{name}_sum"), label, h.sum);
    sample(out, &format!("{name}_count"), label, h.count as f64);
}

/// Go-style float text: integers without a fraction, special values as Prometheus spells them.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{v}")
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

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
            finished_stop: 2,
            finished_length: 0,
            finished_abort: 1,
            ..Default::default()
        };
        let text = render("demo", &stats);
        assert!(
            text.contains("# TYPE mla:num_requests_running gauge\nmla:num_requests_running{model_name=\"demo\"} 3\n")
        );
        assert!(text.contains("mla:num_requests_waiting{model_name=\"demo\"} 2\n"));
        assert!(text.contains("mla:kv_cache_usage_perc{model_name=\"demo\"} 0.25\n"));
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
    }

    #[test]
    fn histograms_are_cumulative_with_inf_sum_and_count() {
        let mut h = Histogram::with_bounds(&[0.01, 0.1, 1.0]);
        for v in [0.005, 0.05, 0.07, 3.0] {
            h.observe(v);
        }
        let stats = EngineStats { time_to_first_token: h, ..Default::default() };
        let text = render("m", &stats);
        // Hand-computed: one value <= 0.01, three <= 0.1, three <= 1, four in all; sum 3.125.
        assert_eq!(
            lines(&text, "mla:time_to_first_token_seconds"),
            vec![
                "mla:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.01\"} 1",
                "mla:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.1\"} 3",
                "mla:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"1\"} 3",
                "mla:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 4",
                "mla:time_to_first_token_seconds_sum{model_name=\"m\"} 3.125",
                "mla:time_to_first_token_seconds_count{model_name=\"m\"} 4",
            ]
        );
        // Every family is declared once, before its samples.
        for name in ["inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"] {
            assert_eq!(text.matches(&format!("# TYPE mla:{name} histogram\n")).count(), 1);
        }
    }

    #[test]
    fn per_rank_gauges_carry_a_rank_label() {
        let ranks = vec![
            RankStats { running: 4, waiting: 1, kv_usage: 0.5, kv_capacity_tokens: 64, load_tokens: 900 },
            RankStats { running: 2, waiting: 0, kv_usage: 0.125, kv_capacity_tokens: 64, load_tokens: 300 },
        ];
        let text = render("m", &EngineStats { ranks, ..Default::default() });
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
    }

    #[test]
    fn label_values_are_escaped() {
        let text = render("a\"b\\c", &EngineStats::default());
        assert!(text.contains("model_name=\"a\\\"b\\\\c\""), "{text}");
    }
}
