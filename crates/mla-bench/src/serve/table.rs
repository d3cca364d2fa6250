//! The result table as `vllm bench serve` prints it (same rows, labels, order and widths, so
//! the two outputs diff line by line), then mla-bench's own prefix-cache section.

use super::metrics::{percentile_word, Metric, ServeMetrics};

/// What the table shows besides the metrics themselves.
pub struct Shown<'a> {
    pub max_concurrency: Option<usize>,
    pub request_rate: f64,
    pub goodput: bool,
    /// `--percentile-metrics`, in the order given.
    pub metrics: &'a [Metric],
    pub percentiles: &'a [f64],
}

/// The metrics vLLM reports among those selected: client queueing only under a concurrency
/// limit, and queue-inclusive latency only when requests also arrive at a finite rate.
pub fn reported(s: &Shown) -> Vec<Metric> {
    s.metrics
        .iter()
        .copied()
        .filter(|m| match m {
            Metric::ClientQueueTime => s.max_concurrency.is_some(),
            Metric::E2elIncludingClientQueue => s.max_concurrency.is_some() && s.request_rate.is_finite(),
            _ => true,
        })
        .collect()
}

pub fn table(m: &ServeMetrics, s: &Shown) -> String {
    let mut out = format!("{:=^50}\n", " Serving Benchmark Result ");
    let mut row = |k: &str, v: String| out.push_str(&format!("{k:<40} {v:<10}\n"));
    let f2 = |x: f64| format!("{x:.2}");
    row("Successful requests:", m.completed.to_string());
    row("Failed requests:", m.failed.to_string());
    if let Some(c) = s.max_concurrency {
        row("Maximum request concurrency:", c.to_string());
    }
    if s.request_rate.is_finite() {
        row("Request rate configured (RPS):", f2(s.request_rate));
    }
    row("Benchmark duration (s):", f2(m.duration_s));
    row("Total input tokens:", m.total_input_tokens.to_string());
    row("Total generated tokens:", m.total_output_tokens.to_string());
    row("Request throughput (req/s):", f2(m.request_throughput));
    if let (true, Some(g)) = (s.goodput, m.request_goodput) {
        row("Request goodput (req/s):", f2(g));
    }
    row("Output token throughput (tok/s):", f2(m.output_throughput));
    row("Peak output token throughput (tok/s):", f2(m.max_output_tokens_per_s));
    row("Peak concurrent requests:", f2(m.max_concurrent_requests as f64));
    row("Total token throughput (tok/s):", f2(m.total_token_throughput));
    for metric in reported(s) {
        let (name, header) = metric.labels();
        let st = m.stats(metric);
        out.push_str(&format!("{header:-^50}\n"));
        let mut row = |k: String, v: f64| out.push_str(&format!("{k:<40} {v:<10.2}\n"));
        row(format!("Mean {name} (ms):"), st.mean_ms);
        row(format!("Median {name} (ms):"), st.median_ms);
        for &p in s.percentiles {
            let word = percentile_word(p);
            row(format!("P{word} {name} (ms):"), st.percentiles[&format!("p{word}")]);
        }
    }
    out.push_str(&format!("{:-^50}\n", "Prefix Cache"));
    out.push_str(&format!("{:<40} {:<10}\n", "Cached prompt tokens:", m.cached_prompt_tokens));
    out.push_str(&format!("{:<40} {:<10.3}\n", "Prefix cache hit rate:", m.prefix_cache_hit_rate));
    if m.ttft_by_turn.len() > 1 {
        for (t, st) in m.ttft_by_turn.iter().enumerate() {
            out.push_str(&format!("{:<40} {:<10.2}\n", format!("Median TTFT, turn {} (ms):", t + 1), st.median_ms));
        }
    }
    out.push_str(&"=".repeat(50));
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::metrics::{calculate, RequestRecord};

    fn metrics() -> ServeMetrics {
        let r = RequestRecord {
            success: true,
            prompt_tokens: 10,
            output_tokens: 3,
            ttft: 0.5,
            itl: vec![0.1, 0.1],
            latency: 0.7,
            ..Default::default()
        };
        calculate(&[r], 1.0, &[50.0, 99.0], &[])
    }

    #[test]
    fn the_table_has_vllms_rows_in_vllms_layout() {
        let m = metrics();
        let metrics = [Metric::Ttft, Metric::Tpot, Metric::Itl];
        let s = Shown {
            max_concurrency: None,
            request_rate: f64::INFINITY,
            goodput: false,
            metrics: &metrics,
            percentiles: &[99.0],
        };
        let t = table(&m, &s);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "============ Serving Benchmark Result ============");
        assert_eq!(lines[1], "Successful requests:                     1         ");
        assert_eq!(lines[3], "Benchmark duration (s):                  1.00      ");
        assert!(lines.contains(&"---------------Time to First Token----------------"));
        assert!(lines.contains(&"-----Time per Output Token (excl. 1st token)------"));
        assert!(lines.contains(&"Mean TTFT (ms):                          500.00    "));
        assert!(lines.contains(&"P99 ITL (ms):                            100.00    "));
        assert!(!t.contains("E2EL") && !t.contains("Maximum request concurrency") && !t.contains("goodput"));
        assert_eq!(*lines.last().unwrap(), "=".repeat(50));
    }

    #[test]
    fn optional_rows_follow_the_run() {
        let m = metrics();
        let metrics = [Metric::E2el, Metric::ClientQueueTime, Metric::E2elIncludingClientQueue];
        let s = Shown {
            max_concurrency: Some(4),
            request_rate: f64::INFINITY,
            goodput: false,
            metrics: &metrics,
            percentiles: &[50.0, 99.0],
        };
        let t = table(&m, &s);
        assert!(t.contains("Maximum request concurrency:             4"));
        assert!(t.contains("P50 E2EL (ms):") && t.contains("Mean Client Queue Time (ms):"));
        // Queue-inclusive latency needs a finite request rate too.
        assert!(!t.contains("E2EL incl. Client Queue"));
        let s = Shown { request_rate: 2.0, ..s };
        assert!(table(&m, &s).contains("Request rate configured (RPS):           2.00"));
        assert_eq!(reported(&s), metrics.to_vec());
    }
}
