//! The periodic log line while the server is busy, as vLLM prints it: requests running and
//! waiting, KV cache usage, prompt and generation throughput over the last interval, and the
//! prefix cache hit rate. Silent while idle, so an idle server's log stays quiet.

use mla_engine::scheduler::SpecStats;
use mla_engine::{EngineHandle, EngineStats, StepCounts};
use std::time::{Duration, Instant};

/// vLLM's default interval is 10 s; 5 s makes a benchmark's first minute readable.
pub const INTERVAL: Duration = Duration::from_secs(5);

/// Logs a line every `INTERVAL` while there is work or there was some since the last line.
pub async fn run(engine: EngineHandle) {
    let mut last = (Instant::now(), engine.stats());
    loop {
        tokio::time::sleep(INTERVAL).await;
        let now = (Instant::now(), engine.stats());
        if let Some(line) = line(&last.1, &now.1, now.0 - last.0) {
            tracing::info!("{line}");
        }
        last = now;
    }
}

/// The line for the interval from `before` to `after`, `None` when nothing happened in it.
pub fn line(before: &EngineStats, after: &EngineStats, elapsed: Duration) -> Option<String> {
    let prompt = after.prompt_tokens_total.saturating_sub(before.prompt_tokens_total);
    let generated = after.generation_tokens_total.saturating_sub(before.generation_tokens_total);
    if after.running + after.waiting == 0 && prompt == 0 && generated == 0 {
        return None;
    }
    let secs = elapsed.as_secs_f64().max(1e-3);
    let queries = after.prefix_cache_queries.saturating_sub(before.prefix_cache_queries);
    let hits = after.prefix_cache_hits.saturating_sub(before.prefix_cache_hits);
    let hit_rate = match queries {
        0 => String::new(),
        q => format!(", prefix cache hit rate {:.1}%{}", 100.0 * hits as f64 / q as f64, per_rank_hits(before, after)),
    };
    let (m0, m1) = (&before.structured_masks, &after.structured_masks);
    let masks = match m1.steps.saturating_sub(m0.steps) {
        0 => String::new(),
        steps => format!(
            ", grammar masks {:.1} per step in {:.0} us",
            m1.masks.saturating_sub(m0.masks) as f64 / steps as f64,
            (m1.seconds - m0.seconds) / steps as f64 * 1e6
        ),
    };
    let (r0, r1) = (&before.routing, &after.routing);
    let routed = match r1.total().saturating_sub(r0.total()) {
        0 => String::new(),
        _ => format!(
            ", routed by prefix {}, balance {}, tie {}, least-loaded {}",
            r1.prefix.saturating_sub(r0.prefix),
            r1.balance.saturating_sub(r0.balance),
            r1.tie.saturating_sub(r0.tie),
            r1.least_loaded.saturating_sub(r0.least_loaded)
        ),
    };
    let steps = step_counts(&before.steps, &after.steps);
    let spec = spec_acceptance(&before.spec, &after.spec);
    Some(format!(
        "prompt {:.1} tok/s, generation {:.1} tok/s, running {}, waiting {}, KV cache {:.1}%{hit_rate}{routed}{masks}{steps}{spec}",
        prompt as f64 / secs,
        generated as f64 / secs,
        after.running,
        after.waiting,
        100.0 * after.kv_usage,
    ))
}

/// Speculative decoding over the interval: the share of drafted tokens that stood, and the
/// mean tokens a verifying row emitted (the drafts that stood plus the target's own).
fn spec_acceptance(before: &SpecStats, after: &SpecStats) -> String {
    let fed = after.draft_tokens.saturating_sub(before.draft_tokens);
    let rows = after.drafts.saturating_sub(before.drafts);
    if fed == 0 || rows == 0 {
        return String::new();
    }
    let stood = after.accepted_tokens.saturating_sub(before.accepted_tokens);
    format!(
        ", draft acceptance {:.1}% ({stood} of {fed}), {:.2} tokens per verify row",
        100.0 * stood as f64 / fed as f64,
        (rows + stood) as f64 / rows as f64
    )
}

/// Mixed steps over the interval, when there were any, and under DP attention how evenly the
/// ranks shared the steps (mean tokens per rank over the busiest rank's: a step lasts as long
/// as its busiest rank).
fn step_counts(before: &StepCounts, after: &StepCounts) -> String {
    let mixed = match after.mixed.saturating_sub(before.mixed) {
        0 => String::new(),
        m => format!(", mixed steps {m} of {}", after.steps.saturating_sub(before.steps)),
    };
    let balance = match after.group_steps.saturating_sub(before.group_steps) {
        0 => String::new(),
        n => format!(", rank balance {:.0}%", 100.0 * (after.balance_sum - before.balance_sum) / n as f64),
    };
    mixed + &balance
}

/// Each attention rank's hit rate over the interval, `-` for a rank that looked nothing up;
/// nothing with one rank, whose rate is the total's.
fn per_rank_hits(before: &EngineStats, after: &EngineStats) -> String {
    if after.ranks.len() < 2 {
        return String::new();
    }
    let rates: Vec<String> = after
        .ranks
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (q0, h0) = before.ranks.get(i).map_or((0, 0), |b| (b.prefix_cache_queries, b.prefix_cache_hits));
            match r.prefix_cache_queries.saturating_sub(q0) {
                0 => "-".to_string(),
                q => format!("{:.1}%", 100.0 * r.prefix_cache_hits.saturating_sub(h0) as f64 / q as f64),
            }
        })
        .collect();
    format!(" (by rank {})", rates.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_intervals_are_described_and_idle_ones_are_not() {
        let idle = EngineStats::default();
        assert_eq!(line(&idle, &idle, INTERVAL), None);
        let busy = EngineStats {
            running: 3,
            waiting: 1,
            kv_usage: 0.25,
            prompt_tokens_total: 1000,
            generation_tokens_total: 50,
            prefix_cache_queries: 1000,
            prefix_cache_hits: 750,
            ..EngineStats::default()
        };
        assert_eq!(
            line(&idle, &busy, Duration::from_secs(5)).unwrap(),
            "prompt 200.0 tok/s, generation 10.0 tok/s, running 3, waiting 1, KV cache 25.0%, prefix cache hit rate 75.0%"
        );
        // Work finished during the interval is still reported once, then silence.
        let done = EngineStats { running: 0, waiting: 0, ..busy.clone() };
        assert!(line(&EngineStats::default(), &done, INTERVAL).is_some());
        assert_eq!(line(&done, &done, INTERVAL), None);
        let masked = EngineStats {
            structured_masks: mla_engine::MaskStats { masks: 64, steps: 2, seconds: 0.0003 },
            ..busy.clone()
        };
        assert!(line(&busy, &masked, INTERVAL).unwrap().ends_with(", grammar masks 32.0 per step in 150 us"));
        // Two ranks: one step fed 8 and 8 tokens, one fed 8 and 0 (mixed): (1 + 0.5) / 2.
        let mut steps = StepCounts::default();
        steps.record(&[8, 8], false);
        steps.record(&[8, 0], true);
        steps.record(&[0, 0], false);
        let stepped = EngineStats { steps, ..busy.clone() };
        assert!(
            line(&busy, &stepped, INTERVAL).unwrap().ends_with(", mixed steps 1 of 3, rank balance 75%"),
            "{}",
            line(&busy, &stepped, INTERVAL).unwrap()
        );
    }

    #[test]
    fn several_ranks_show_their_hit_rates_and_the_routing() {
        use mla_engine::{RankStats, RoutingStats};
        let rank = |q, h| RankStats { prefix_cache_queries: q, prefix_cache_hits: h, ..RankStats::default() };
        let before = EngineStats {
            ranks: vec![rank(100, 0), rank(100, 50), rank(0, 0)],
            prefix_cache_queries: 200,
            prefix_cache_hits: 50,
            routing: RoutingStats { prefix: 3, balance: 0, tie: 4, least_loaded: 0 },
            ..EngineStats::default()
        };
        let after = EngineStats {
            running: 1,
            ranks: vec![rank(300, 150), rank(200, 50), rank(0, 0)],
            prefix_cache_queries: 500,
            prefix_cache_hits: 200,
            routing: RoutingStats { prefix: 8, balance: 1, tie: 4, least_loaded: 0 },
            ..EngineStats::default()
        };
        // Rank 0: 150 of 200 tokens found; rank 1: none of 100; rank 2 looked nothing up.
        assert!(
            line(&before, &after, INTERVAL).unwrap().ends_with(
                ", prefix cache hit rate 50.0% (by rank 75.0% 0.0% -), routed by prefix 5, balance 1, tie 0, least-loaded 0"
            ),
            "{:?}",
            line(&before, &after, INTERVAL)
        );
    }
}
