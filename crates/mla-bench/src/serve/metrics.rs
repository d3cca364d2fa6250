//! Serving metrics with `vllm bench serve`'s definitions (vllm/benchmarks/serve.py,
//! `calculate_metrics`), so figures compare one to one:
//! - TTFT: request sent → first streamed chunk carrying a choice.
//! - ITL: the gaps between consecutive such chunks, pooled over all requests.
//! - TPOT: per request, (latency − TTFT) / (output tokens − 1), for requests with more than
//!   one output token; statistics over those requests.
//! - E2EL: request sent → last chunk carrying a choice.
//! - Throughputs: totals of the successful requests over the benchmark's wall time.
//! - Goodput: successful requests within every given SLO (TTFT, TPOT, E2EL in ms; a request
//!   with at most one output token counts TPOT 0), per second.
//! - Mean, median, population standard deviation and percentiles as numpy computes them
//!   (`np.std`'s ddof 0, `np.percentile`'s linear interpolation); an empty list gives 0, as
//!   vLLM's `values or 0`.

use serde::Serialize;
use std::collections::BTreeMap;

/// What one request measured, in seconds.
#[derive(Debug, Clone, Default)]
pub struct RequestRecord {
    pub success: bool,
    /// The prompt's length as the dataset planned it, replaced by the server's usage count.
    pub prompt_tokens: usize,
    /// Output tokens as the server counted them (usage), else streamed chunks.
    pub output_tokens: usize,
    pub ttft: f64,
    /// Gaps between consecutive output chunks.
    pub itl: Vec<f64>,
    pub latency: f64,
    /// When it was sent, since the benchmark started (vLLM's `start_time`).
    pub start: f64,
    /// Time spent waiting for a `--max-concurrency` slot (vLLM's `client_queue_time`).
    pub queue_time: f64,
    pub generated_text: String,
    pub error: Option<String>,
    /// Prompt tokens the server found in its prefix cache (`usage.prompt_tokens_details`).
    pub cached_tokens: usize,
    /// Turn of its conversation (multi-turn dataset; 0 otherwise).
    pub turn: usize,
    /// The output's token ids, when asked for (multi-turn: the next turn's prompt holds them).
    pub output_ids: Vec<u32>,
}

/// The per-request metrics `--percentile-metrics` may name, in vLLM's order and spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    Ttft,
    Tpot,
    Itl,
    E2el,
    ClientQueueTime,
    E2elIncludingClientQueue,
}

impl Metric {
    pub const ALL: [Metric; 6] = [
        Metric::Ttft,
        Metric::Tpot,
        Metric::Itl,
        Metric::E2el,
        Metric::ClientQueueTime,
        Metric::E2elIncludingClientQueue,
    ];

    /// The key in result files (`mean_<key>_ms`) and in `--percentile-metrics`.
    pub fn key(self) -> &'static str {
        match self {
            Metric::Ttft => "ttft",
            Metric::Tpot => "tpot",
            Metric::Itl => "itl",
            Metric::E2el => "e2el",
            Metric::ClientQueueTime => "client_queue_time",
            Metric::E2elIncludingClientQueue => "e2el_including_client_queue",
        }
    }

    /// The short name and section header of the printed table.
    pub fn labels(self) -> (&'static str, &'static str) {
        match self {
            Metric::Ttft => ("TTFT", "Time to First Token"),
            Metric::Tpot => ("TPOT", "Time per Output Token (excl. 1st token)"),
            Metric::Itl => ("ITL", "Inter-token Latency"),
            Metric::E2el => ("E2EL", "End-to-end Latency"),
            Metric::ClientQueueTime => ("Client Queue Time", "Client-side Queueing"),
            Metric::E2elIncludingClientQueue => ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
        }
    }

    pub fn parse(s: &str) -> anyhow::Result<Metric> {
        Metric::ALL.into_iter().find(|m| m.key() == s.trim()).ok_or_else(|| {
            let names: Vec<_> = Metric::ALL.iter().map(|m| m.key()).collect();
            anyhow::anyhow!("--percentile-metrics: unknown metric {s:?} (expected {})", names.join(", "))
        })
    }
}

/// A service-level objective of `--goodput`: the metric (TTFT, TPOT or E2EL) and its bound in ms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    pub metric: Metric,
    pub ms: f64,
}

impl Slo {
    /// `KEY:VALUE` as vLLM's `--goodput` takes it, e.g. `ttft:200`.
    pub fn parse(s: &str) -> anyhow::Result<Slo> {
        let bad = || anyhow::anyhow!("--goodput {s:?}: expected KEY:VALUE, KEY one of ttft, tpot, e2el, VALUE in ms");
        let (k, v) = s.split_once(':').ok_or_else(bad)?;
        let metric = match k.trim() {
            "ttft" => Metric::Ttft,
            "tpot" => Metric::Tpot,
            "e2el" => Metric::E2el,
            _ => return Err(bad()),
        };
        let ms: f64 = v.trim().parse().map_err(|_| bad())?;
        anyhow::ensure!(ms >= 0.0, "--goodput {s:?}: the objective must be non-negative");
        Ok(Slo { metric, ms })
    }
}

/// Summary of one metric in milliseconds. `p99_ms` is always there (earlier result files and
/// scripts/plot_performance.py read it); `percentiles` holds those `--metric-percentiles` asked
/// for, keyed as vLLM names them (`p99`, `p99.9`).
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct Stats {
    pub mean_ms: f64,
    pub median_ms: f64,
    pub std_ms: f64,
    pub p99_ms: f64,
    pub percentiles: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ServeMetrics {
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    /// None unless `--goodput` set objectives.
    pub request_goodput: Option<f64>,
    pub input_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    /// Most output chunks in one whole second of the run, and the most requests in flight at once.
    pub max_output_tokens_per_s: f64,
    pub max_concurrent_requests: usize,
    pub ttft: Stats,
    pub tpot: Stats,
    pub itl: Stats,
    pub e2el: Stats,
    pub client_queue_time: Stats,
    pub e2el_including_client_queue: Stats,
    /// Prompt tokens served from the prefix cache, and their share of all prompt tokens.
    pub cached_prompt_tokens: usize,
    pub prefix_cache_hit_rate: f64,
    /// TTFT by turn of the multi-turn dataset (one entry otherwise).
    pub ttft_by_turn: Vec<Stats>,
    /// Output tokens of every request in order, 0 for a failed one (vLLM's `output_lens`).
    #[serde(skip)]
    pub output_lens: Vec<usize>,
}

impl ServeMetrics {
    pub fn stats(&self, m: Metric) -> &Stats {
        match m {
            Metric::Ttft => &self.ttft,
            Metric::Tpot => &self.tpot,
            Metric::Itl => &self.itl,
            Metric::E2el => &self.e2el,
            Metric::ClientQueueTime => &self.client_queue_time,
            Metric::E2elIncludingClientQueue => &self.e2el_including_client_queue,
        }
    }
}

/// numpy.percentile(values, q) with the default linear method; 0 for no values.
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

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// numpy.std: the population standard deviation (ddof 0).
pub fn std_dev(values: &[f64]) -> f64 {
    let m = mean(values);
    mean(&values.iter().map(|v| (v - m) * (v - m)).collect::<Vec<_>>()).sqrt()
}

/// How vLLM names percentile `p` in keys and rows: `99` for 99.0, `99.9` otherwise.
pub fn percentile_word(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("{}", p as i64)
    } else {
        format!("{p}")
    }
}

fn stats_ms(values: &[f64], percentiles: &[f64]) -> Stats {
    Stats {
        mean_ms: mean(values) * 1e3,
        median_ms: percentile(values, 50.0) * 1e3,
        std_ms: std_dev(values) * 1e3,
        p99_ms: percentile(values, 99.0) * 1e3,
        percentiles: percentiles
            .iter()
            .map(|&p| (format!("p{}", percentile_word(p)), percentile(values, p) * 1e3))
            .collect(),
    }
}

/// Every metric of `records` (in request order) over a run of `duration_s`.
pub fn calculate(records: &[RequestRecord], duration_s: f64, percentiles: &[f64], goodput: &[Slo]) -> ServeMetrics {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
    let total_in: usize = ok.iter().map(|r| r.prompt_tokens).sum();
    let total_out: usize = ok.iter().map(|r| r.output_tokens).sum();
    let ttfts: Vec<f64> = ok.iter().map(|r| r.ttft).collect();
    // TPOT per request; goodput counts a request of at most one token as TPOT 0.
    let tpot_of =
        |r: &RequestRecord| (r.output_tokens > 1).then(|| (r.latency - r.ttft) / (r.output_tokens - 1) as f64);
    let tpots: Vec<f64> = ok.iter().filter_map(|r| tpot_of(r)).collect();
    let itls: Vec<f64> = ok.iter().flat_map(|r| r.itl.iter().copied()).collect();
    let e2els: Vec<f64> = ok.iter().map(|r| r.latency).collect();
    let queues: Vec<f64> = ok.iter().map(|r| r.queue_time).collect();
    let with_queue: Vec<f64> = ok.iter().map(|r| r.latency + r.queue_time).collect();
    let good = ok
        .iter()
        .filter(|r| {
            goodput.iter().all(|slo| {
                let v = match slo.metric {
                    Metric::Ttft => r.ttft,
                    Metric::Tpot => tpot_of(r).unwrap_or(0.0),
                    _ => r.latency,
                };
                v <= slo.ms / 1e3
            })
        })
        .count();
    let (max_output_tokens_per_s, max_concurrent_requests) = peaks(&ok);
    let stats = |v: &[f64]| stats_ms(v, percentiles);
    ServeMetrics {
        completed: ok.len(),
        failed: records.len() - ok.len(),
        duration_s,
        total_input_tokens: total_in,
        total_output_tokens: total_out,
        request_throughput: ok.len() as f64 / duration_s,
        request_goodput: (!goodput.is_empty()).then(|| good as f64 / duration_s),
        input_throughput: total_in as f64 / duration_s,
        output_throughput: total_out as f64 / duration_s,
        total_token_throughput: (total_in + total_out) as f64 / duration_s,
        max_output_tokens_per_s,
        max_concurrent_requests,
        ttft: stats(&ttfts),
        tpot: stats(&tpots),
        itl: stats(&itls),
        e2el: stats(&e2els),
        client_queue_time: stats(&queues),
        e2el_including_client_queue: stats(&with_queue),
        cached_prompt_tokens: ok.iter().map(|r| r.cached_tokens).sum(),
        prefix_cache_hit_rate: ok.iter().map(|r| r.cached_tokens).sum::<usize>() as f64 / total_in.max(1) as f64,
        ttft_by_turn: (0..=ok.iter().map(|r| r.turn).max().unwrap_or(0))
            .map(|t| stats(&ok.iter().filter(|r| r.turn == t).map(|r| r.ttft).collect::<Vec<_>>()))
            .collect(),
        output_lens: records.iter().map(|r| if r.success { r.output_tokens } else { 0 }).collect(),
    }
}

/// vLLM's peak figures: output chunks (first at TTFT, then one per ITL gap) counted in
/// whole-second buckets from the first request's start, the fullest bucket; and the most
/// requests in flight at one instant, each over [start, start + latency).
fn peaks(ok: &[&RequestRecord]) -> (f64, usize) {
    let Some(t0) = ok.iter().map(|r| r.start).min_by(f64::total_cmp) else { return (0.0, 0) };
    let end = ok.iter().map(|r| r.start + r.latency).fold(t0, f64::max);
    let mut buckets = vec![0usize; (end - t0).ceil() as usize + 1];
    for r in ok {
        let mut t = r.start + r.ttft;
        for gap in std::iter::once(0.0).chain(r.itl.iter().copied()) {
            t += gap;
            if let Some(b) = buckets.get_mut((t - t0) as usize) {
                *b += 1;
            }
        }
    }
    // Ends sort before starts at the same instant: the intervals are half-open.
    let mut events: Vec<(f64, i32)> = ok.iter().flat_map(|r| [(r.start, 1), (r.start + r.latency, -1)]).collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut peak) = (0i32, 0i32);
    for (_, d) in events {
        now += d;
        peak = peak.max(now);
    }
    (buckets.into_iter().max().unwrap_or(0) as f64, peak as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn rec(out: usize, ttft: f64, itl: &[f64]) -> RequestRecord {
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

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentile_and_std_match_numpy() {
        // numpy.percentile([1, 2, 3, 4], [50, 99, 0, 100]) = [2.5, 3.97, 1, 4]
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!((percentile(&v, 0.0), percentile(&v, 100.0)), (1.0, 4.0));
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
        // numpy.std([1, 2, 3, 4]) = sqrt(1.25) (population, not the sample's sqrt(5/3)).
        assert!(close(std_dev(&v), 1.25f64.sqrt()));
        assert_eq!(std_dev(&[]), 0.0);
        assert_eq!(
            (percentile_word(99.0), percentile_word(99.9), percentile_word(50.0)),
            ("99".into(), "99.9".into(), "50".into())
        );
    }

    #[test]
    fn slo_and_metric_names_parse_as_vllm_spells_them() {
        assert_eq!(Slo::parse("ttft:200").unwrap(), Slo { metric: Metric::Ttft, ms: 200.0 });
        assert_eq!(Slo::parse("tpot:12.5").unwrap(), Slo { metric: Metric::Tpot, ms: 12.5 });
        assert!(Slo::parse("itl:5").is_err() && Slo::parse("ttft").is_err() && Slo::parse("e2el:-1").is_err());
        assert_eq!(Metric::parse("e2el").unwrap(), Metric::E2el);
        assert!(Metric::parse("latency").is_err());
    }

    #[test]
    fn recorded_timings_give_vllm_definitions() {
        // Four successful requests and a failed one, timings in seconds, computed by hand with
        // vLLM's definitions (vllm/benchmarks/serve.py `calculate_metrics`, which in vLLM 0.33
        // returns these same figures for these records):
        // A: 4 tokens, start 0.0, TTFT 0.1, gaps 0.01 0.02 0.03 → E2EL 0.16, TPOT 0.06/3 = 0.02
        // B: 2 tokens, start 0.5, TTFT 0.3, gap 0.05            → E2EL 0.35, TPOT 0.05
        // C: 1 token,  start 1.2, TTFT 0.2                       → E2EL 0.2, no TPOT, no ITL
        // D: 3 tokens, start 1.3, TTFT 0.4, gaps 0.1 0.1         → E2EL 0.6, TPOT 0.1
        // E: failed: counted as failed, in no other figure.
        let mut records = vec![rec(4, 0.1, &[0.01, 0.02, 0.03]), rec(2, 0.3, &[0.05]), rec(1, 0.2, &[])];
        records.push(rec(3, 0.4, &[0.1, 0.1]));
        let mut failed = rec(9, 9.0, &[9.0]);
        failed.success = false;
        records.push(failed);
        for (r, (start, queue)) in records.iter_mut().zip([(0.0, 0.0), (0.5, 0.1), (1.2, 0.0), (1.3, 0.2), (9.0, 9.0)])
        {
            (r.start, r.queue_time) = (start, queue);
        }
        let slos = [Slo { metric: Metric::Ttft, ms: 300.0 }, Slo { metric: Metric::Tpot, ms: 60.0 }];
        let m = calculate(&records, 2.0, &[50.0, 90.0, 99.0], &slos);
        assert_eq!((m.completed, m.failed, m.total_input_tokens, m.total_output_tokens), (4, 1, 40, 10));
        assert_eq!(m.output_lens, vec![4, 2, 1, 3, 0]);
        assert!(close(m.request_throughput, 2.0) && close(m.output_throughput, 5.0));
        assert!(close(m.input_throughput, 20.0) && close(m.total_token_throughput, 25.0));
        // Goodput (TTFT ≤ 300 ms, TPOT ≤ 60 ms, bounds included): A (100 ms, 20 ms), B (300, 50)
        // and C (200, TPOT 0) meet both; D (400, 100) does not.
        assert!(close(m.request_goodput.unwrap(), 1.5));

        // TTFT over 100, 300, 200, 400 ms: mean 250, median 250, population std sqrt(12500),
        // p90 at rank 2.7 of [100, 200, 300, 400] = 370, p99 at rank 2.97 = 397.
        assert!(close(m.ttft.mean_ms, 250.0) && close(m.ttft.median_ms, 250.0));
        assert!(close(m.ttft.std_ms, 12_500f64.sqrt()));
        assert!(close(m.ttft.percentiles["p90"], 370.0) && close(m.ttft.p99_ms, 397.0));
        assert!(close(m.ttft.percentiles["p99"], 397.0) && close(m.ttft.percentiles["p50"], 250.0));
        // TPOT over A, B, D only: 20, 50, 100 ms → mean 170/3, median 50, std of the three.
        assert!(close(m.tpot.mean_ms, 170.0 / 3.0) && close(m.tpot.median_ms, 50.0));
        let d = [20.0 - 170.0 / 3.0, 50.0 - 170.0 / 3.0, 100.0 - 170.0 / 3.0];
        assert!(close(m.tpot.std_ms, (d.iter().map(|x| x * x).sum::<f64>() / 3.0).sqrt()));
        assert!(close(m.tpot.p99_ms, 50.0 + 0.98 * 50.0));
        // ITL pooled over every gap: 10, 20, 30, 50, 100, 100 ms → mean 310/6, median 40,
        // p99 at rank 4.95 = 100.
        assert!(close(m.itl.mean_ms, 310.0 / 6.0) && close(m.itl.median_ms, 40.0) && close(m.itl.p99_ms, 100.0));
        // E2EL: 160, 350, 200, 600 ms.
        assert!(close(m.e2el.mean_ms, 327.5) && close(m.e2el.median_ms, 275.0));
        // Client queue: 0, 100, 0, 200 ms; with E2EL: 160, 450, 200, 800.
        assert!(close(m.client_queue_time.mean_ms, 75.0) && close(m.e2el_including_client_queue.mean_ms, 402.5));
        // Peak concurrency: D starts (1.3) while C (1.2-1.4) runs, nothing else overlaps: 2.
        // Chunks by whole second from 0: A's 4 (0.1-0.16) and B's 2 (0.8, 0.85) in second 0;
        // C's 1 (1.4), D's 3 (1.7, 1.8, 1.9) in second 1: the peak is 6.
        assert_eq!(m.max_concurrent_requests, 2);
        assert!(close(m.max_output_tokens_per_s, 6.0));
    }

    #[test]
    fn no_goodput_objectives_give_no_goodput_and_no_success_gives_zeros() {
        let m = calculate(&[rec(3, 0.5, &[0.1, 0.1])], 1.0, &[99.0], &[]);
        assert_eq!(m.request_goodput, None);
        let mut r = rec(3, 0.5, &[0.1]);
        r.success = false;
        let m = calculate(&[r], 1.0, &[99.0], &[Slo { metric: Metric::E2el, ms: 1.0 }]);
        assert_eq!((m.completed, m.failed, m.max_concurrent_requests), (0, 1, 0));
        assert_eq!(
            (m.ttft.mean_ms, m.ttft.std_ms, m.itl.percentiles["p99"], m.request_goodput),
            (0.0, 0.0, 0.0, Some(0.0))
        );
    }

    #[test]
    fn tpot_differs_from_mean_itl_when_requests_have_different_lengths() {
        // vLLM's TPOT averages per request; ITL pools gaps. One long request with slow gaps and
        // one short with fast gaps separate the two.
        let records = vec![rec(5, 0.0, &[0.1, 0.1, 0.1, 0.1]), rec(2, 0.0, &[0.01])];
        let m = calculate(&records, 1.0, &[99.0], &[]);
        assert!(close(m.tpot.mean_ms, 55.0));
        assert!(close(m.itl.mean_ms, 82.0));
    }
}
