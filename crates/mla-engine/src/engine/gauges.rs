//! What the engine thread writes into the shared statistics beyond each request's own record:
//! the gauges it publishes after every iteration (per rank and in total: running, waiting, KV
//! cache use, load, prefix cache hits, preemptions, structured-output masks) and the tokens each
//! step computes. Kept out of the loop, which only says when.

use super::rank_loads::RankLoads;
use crate::metrics::Metrics;
use crate::scheduler::Scheduler;
use crate::stats::{MaskStats, RankStats};
use mla_core::step::plan::{StepKind, StepPlan};

/// Each rank that works in this step counts its tokens as vLLM's `iteration_tokens_total` does:
/// prompt tokens computed plus tokens sampled. A decode step feeds the token it samples after,
/// so it counts one per sequence; a prompt chunk counts its tokens and, when it ends its prompt,
/// the first token drawn. A mixed step counts both.
pub(super) fn count_step_tokens(metrics: &Metrics, plans: &[StepPlan]) {
    let mut stats = metrics.lock();
    let fed: Vec<usize> = plans.iter().map(StepPlan::num_tokens).collect();
    let mixed = plans.iter().any(|p| matches!(p.kind, StepKind::Mixed { .. }) && !p.seqs.is_empty());
    stats.steps.record(&fed, mixed);
    for plan in plans.iter().filter(|p| !p.seqs.is_empty()) {
        let sampled = plan.seqs.iter().filter(|s| s.sample.is_some()).count();
        let prompt_tokens: usize = plan.split().0.iter().map(|s| s.tokens.len()).sum();
        let tokens = prompt_tokens + sampled;
        stats.iteration_tokens.observe(tokens as f64);
    }
}

/// Publishes the ranks' state as it stands now.
pub(super) fn publish(metrics: &Metrics, ranks: &[Scheduler], loads: &RankLoads, masks: MaskStats) {
    let mut stats = metrics.lock();
    stats.ranks = ranks
        .iter()
        .enumerate()
        .map(|(i, s)| RankStats {
            running: s.num_running(),
            waiting: s.num_waiting(),
            kv_usage: s.block_manager().usage(),
            kv_capacity_tokens: s.block_manager().num_blocks() * s.block_manager().block_size(),
            load_tokens: loads.get(i),
            prefix_cache_queries: s.prefix_cache_stats().queries,
            prefix_cache_hits: s.prefix_cache_stats().hits,
        })
        .collect();
    stats.running = stats.ranks.iter().map(|r| r.running).sum();
    stats.waiting = stats.ranks.iter().map(|r| r.waiting).sum();
    let used: f64 = stats.ranks.iter().map(|r| r.kv_usage * r.kv_capacity_tokens as f64).sum();
    stats.kv_usage = used / stats.kv_capacity_tokens.max(1) as f64;
    stats.preemptions_total = ranks.iter().map(Scheduler::preemptions).sum();
    stats.prefix_cache_queries = ranks.iter().map(|s| s.prefix_cache_stats().queries).sum();
    stats.prefix_cache_hits = ranks.iter().map(|s| s.prefix_cache_stats().hits).sum();
    stats.structured_masks = masks;
    stats.spec = Default::default();
    for r in ranks.iter() {
        stats.spec.merge(r.spec_stats());
    }
}
