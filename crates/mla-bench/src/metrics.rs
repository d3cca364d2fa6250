//! Serving metrics with `vllm bench serve`'s definitions (vllm/benchmarks/serve.py,
//! `calculate_metrics`), so figures compare one to one:
//! - TTFT: request sent → first streamed chunk carrying output.
//! - ITL: the gaps between consecutive output chunks, pooled over all requests.
//! - TPOT: per request, (latency − TTFT) / (output tokens − 1), for requests with more than
//!   one output token; mean/median/p99 over those requests.
//! - E2EL: request sent → last chunk.
//! - Throughputs: totals over the benchmark's wall time (first send → last completion).
//! - Percentiles: linear interpolation between closest ranks (numpy's default).

use serde::Serialize;

/// What one request measured, in seconds since it was sent.
#[derive(Debug, Clone, Default)]
pub struct RequestRecord {
    pub success: bool,
    pub prompt_tokens: usize,
    /// Output tokens as the server counted them (usage), else streamed tokens.
    pub output_tokens: usize,
    pub ttft: f64,
    /// Gaps between consecutive output chunks.
    pub itl: Vec<f64>,
    pub latency: f64,
    pub error: Option<String>,
    /// Prompt tokens the server found in its prefix cache (`usage.prompt_tokens_details`).
    pub cached_tokens: usize,
    /// Turn of its conversation (multi-turn dataset; 0 otherwise).
    pub turn: usize,
    /// The output's token ids, when asked for (multi-turn: the next turn's prompt holds them).
    pub output_ids: Vec<u32>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Stats {
    pub mean_ms: f64,
    pub median_ms: f64,
    pub p99_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ServeMetrics {
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub input_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft: Stats,
    pub tpot: Stats,
    pub itl: Stats,
    pub e2el: Stats,
    /// Prompt tokens served from the prefix cache, and their share of all prompt tokens.
    pub cached_prompt_tokens: usize,
    pub prefix_cache_hit_rate: f64,
    /// TTFT by turn of the multi-turn dataset (one entry otherwise).
    pub ttft_by_turn: Vec<Stats>,
}

/// numpy.percentile(values, q) with the default linear method; 0 for no values (as vLLM, which
/// passes `or 0` lists).
pub fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).expect("timings are finite"));
    let rank = q / 100.0 * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}

fn stats_ms(values: &[f64]) -> Stats {
    let mean = if values.is_empty() { 0.0 } else { values.iter().sum::<f64>() / values.len() as f64 };
    Stats { mean_ms: mean * 1e3, median_ms: percentile(values, 50.0) * 1e3, p99_ms: percentile(values, 99.0) * 1e3 }
}

pub fn calculate(records: &[RequestRecord], duration_s: f64) -> ServeMetrics {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
    let total_in: usize = ok.iter().map(|r| r.prompt_tokens).sum();
    let total_out: usize = ok.iter().map(|r| r.output_tokens).sum();
    let ttfts: Vec<f64> = ok.iter().map(|r| r.ttft).collect();
    let tpots: Vec<f64> = ok
        .iter()
        .filter(|r| r.output_tokens > 1)
        .map(|r| (r.latency - r.ttft) / (r.output_tokens - 1) as f64)
        .collect();
    let itls: Vec<f64> = ok.iter().flat_map(|r| r.itl.iter().copied()).collect();
    let e2els: Vec<f64> = ok.iter().map(|r| r.latency).collect();
    ServeMetrics {
        completed: ok.len(),
        failed: records.len() - ok.len(),
        duration_s,
        total_input_tokens: total_in,
        total_output_tokens: total_out,
        request_throughput: ok.len() as f64 / duration_s,
        input_throughput: total_in as f64 / duration_s,
        output_throughput: total_out as f64 / duration_s,
        total_token_throughput: (total_in + total_out) as f64 / duration_s,
        ttft: stats_ms(&ttfts),
        tpot: stats_ms(&tpots),
        itl: stats_ms(&itls),
        e2el: stats_ms(&e2els),
        cached_prompt_tokens: ok.iter().map(|r| r.cached_tokens).sum(),
        prefix_cache_hit_rate: ok.iter().map(|r| r.cached_tokens).sum::<usize>() as f64 / total_in.max(1) as f64,
        ttft_by_turn: (0..=ok.iter().map(|r| r.turn).max().unwrap_or(0))
            .map(|t| stats_ms(&ok.iter().filter(|r| r.turn == t).map(|r| r.ttft).collect::<Vec<_>>()))
            .collect(),
    }
}

/// The table `vllm bench serve` prints, in the same order.
pub fn table(m: &ServeMetrics) -> String {
    let mut s = String::new();
    let mut row = |k: &str, v: String| s.push_str(&format!("{k:<40}{v:>12}\n"));
    row("Successful requests:", m.completed.to_string());
    row("Failed requests:", m.failed.to_string());
    row("Benchmark duration (s):", format!("{:.2}", m.duration_s));
    row("Total input tokens:", m.total_input_tokens.to_string());
    row("Total generated tokens:", m.total_output_tokens.to_string());
    row("Request throughput (req/s):", format!("{:.2}", m.request_throughput));
    row("Input token throughput (tok/s):", format!("{:.2}", m.input_throughput));
    row("Output token throughput (tok/s):", format!("{:.2}", m.output_throughput));
    row("Total token throughput (tok/s):", format!("{:.2}", m.total_token_throughput));
    for (name, st) in [("TTFT", &m.ttft), ("TPOT", &m.tpot), ("ITL", &m.itl), ("E2EL", &m.e2el)] {
        row(&format!("Mean {name} (ms):"), format!("{:.2}", st.mean_ms));
        row(&format!("Median {name} (ms):"), format!("{:.2}", st.median_ms));
        row(&format!("P99 {name} (ms):"), format!("{:.2}", st.p99_ms));
    }
    row("Prefix cache hit rate:", format!("{:.3}", m.prefix_cache_hit_rate));
    if m.ttft_by_turn.len() > 1 {
        for (t, st) in m.ttft_by_turn.iter().enumerate() {
            row(&format!("Median TTFT, turn {} (ms):", t + 1), format!("{:.2}", st.median_ms));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(out: usize, ttft: f64, itl: &[f64]) -> RequestRecord {
        let latency = ttft + itl.iter().sum::<f64>();
        RequestRecord {
            success: true,
            prompt_tokens: 10,
            output_tokens: out,
            ttft,
            itl: itl.to_vec(),
            latency,
            ..Default::default()
        }
    }

    #[test]
    fn percentile_matches_numpy_linear_interpolation() {
        // numpy.percentile([1, 2, 3, 4], [50, 99, 0, 100]) = [2.5, 3.97, 1, 4]
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!((percentile(&v, 0.0), percentile(&v, 100.0)), (1.0, 4.0));
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn hand_made_timings_give_vllm_definitions() {
        // A: 4 tokens, TTFT 0.1 s, gaps 0.01, 0.02, 0.03 → latency 0.16, TPOT 0.06 / 3 = 0.02.
        // B: 2 tokens, TTFT 0.3 s, gap 0.05 → latency 0.35, TPOT 0.05.
        // C: 1 token, TTFT 0.2 s → no TPOT, no ITL.
        // D: failed → counted as failed, excluded everywhere else.
        let mut failed = rec(9, 9.0, &[9.0]);
        failed.success = false;
        let records = vec![rec(4, 0.1, &[0.01, 0.02, 0.03]), rec(2, 0.3, &[0.05]), rec(1, 0.2, &[]), failed];
        let m = calculate(&records, 2.0);
        assert_eq!((m.completed, m.failed, m.total_input_tokens, m.total_output_tokens), (3, 1, 30, 7));
        assert!((m.request_throughput - 1.5).abs() < 1e-12);
        assert!((m.output_throughput - 3.5).abs() < 1e-12);
        assert!((m.input_throughput - 15.0).abs() < 1e-12);
        assert!((m.total_token_throughput - 18.5).abs() < 1e-12);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        // TTFT over A, B, C: 100, 300, 200 ms.
        assert!(close(m.ttft.mean_ms, 200.0) && close(m.ttft.median_ms, 200.0));
        assert!(close(m.ttft.p99_ms, 200.0 + 0.98 * 100.0));
        // TPOT over A and B only: 20 and 50 ms.
        assert!(close(m.tpot.mean_ms, 35.0) && close(m.tpot.median_ms, 35.0));
        assert!(close(m.tpot.p99_ms, 20.0 + 0.99 * 30.0));
        // ITL pooled over every gap: 10, 20, 30, 50 ms.
        assert!(close(m.itl.mean_ms, 27.5) && close(m.itl.median_ms, 25.0));
        assert!(close(m.itl.p99_ms, 30.0 + 0.97 * 20.0));
        // E2EL: 160, 350, 200 ms.
        assert!(close(m.e2el.median_ms, 200.0) && close(m.e2el.mean_ms, 710.0 / 3.0));
    }

    #[test]
    fn tpot_differs_from_mean_itl_when_requests_have_different_lengths() {
        // vLLM's TPOT averages per request; ITL pools gaps. One long request with slow gaps and
        // one short with fast gaps separate the two.
        let records = vec![rec(5, 0.0, &[0.1, 0.1, 0.1, 0.1]), rec(2, 0.0, &[0.01])];
        let m = calculate(&records, 1.0);
        assert!((m.tpot.mean_ms - 55.0).abs() < 1e-9);
        assert!((m.itl.mean_ms - 82.0).abs() < 1e-9);
    }

    #[test]
    fn table_lists_every_metric() {
        let t = table(&calculate(&[rec(3, 0.5, &[0.1, 0.1])], 1.0));
        for k in ["Successful requests:", "Output token throughput", "Median TTFT", "P99 TPOT", "Mean ITL", "P99 E2EL"]
        {
            assert!(t.contains(k), "{k} missing from\n{t}");
        }
    }
}
