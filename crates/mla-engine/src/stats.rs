//! The engine's statistics as `/metrics` and the stats line read them: a consistent snapshot of
//! its counters and histograms (`EngineStats`), per attention rank and summed over replicas.

use crate::histogram::Histogram;
use crate::request_stats::RequestStats;
use std::time::Duration;

/// One attention rank's share: its scheduler, its KV cache and the work routed to it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankStats {
    pub running: usize,
    pub waiting: usize,
    /// Fraction of this rank's KV cache blocks in use, 0..=1.
    pub kv_usage: f64,
    pub kv_capacity_tokens: usize,
    /// Tokens its live requests may hold at most (what the router balances).
    pub load_tokens: u64,
    /// Its prefix cache's counters (as `EngineStats::prefix_cache_queries` and `_hits`).
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
}

/// The router's decisions since start, by reason (see `RouterPolicy`). A layout with one
/// attention rank decides nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoutingStats {
    /// To the rank holding the longest cached prefix.
    pub prefix: u64,
    /// To the least-loaded rank, the prefix holder having too much work (the balance rule).
    pub balance: u64,
    /// To the least-loaded rank, no rank holding more of the prefix than another (or the
    /// request wanting prompt logprobs, which computes its whole prompt anyway).
    pub tie: u64,
    /// To the least-loaded rank under `RouterPolicy::LeastLoaded`.
    pub least_loaded: u64,
}

impl RoutingStats {
    pub fn total(&self) -> u64 {
        self.prefix + self.balance + self.tie + self.least_loaded
    }
}

/// A consistent snapshot of the engine's counters, for `/metrics` and the startup log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    /// Fraction of all KV cache blocks in use, 0..=1.
    pub kv_usage: f64,
    pub kv_capacity_tokens: usize,
    /// Every attention rank (every replica's, in order): one entry on a single device.
    pub ranks: Vec<RankStats>,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Finished completions by the reason the engine ended them: stop (stop token, or the caller's
    /// `finish_choice(.., Stop)` for a stop string), length, abort (aborted, client gone, failed,
    /// or refused at shutdown).
    pub finished_stop: u64,
    pub finished_length: u64,
    pub finished_abort: u64,
    pub preemptions_total: u64,
    /// Prompt tokens looked up in the prefix cache at admission, and found there.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub routing: RoutingStats,
    /// Structured-output grammar masks computed, and the host time it took.
    pub structured_masks: MaskStats,
    /// Steps by kind, and how evenly the ranks of a DP-attention group shared them.
    pub steps: StepCounts,
    /// Speculative decoding: drafts fed and how many stood.
    pub spec: crate::scheduler::SpecStats,
    /// Seconds.
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_latency: Histogram,
    pub queue_time: Histogram,
    /// Tokens each attention rank fed in one step (prompt chunks and decode tokens together).
    pub iteration_tokens: Histogram,
    /// Whole requests, recorded when they end.
    pub requests: RequestStats,
}

impl EngineStats {
    /// Folds another replica's counters into these (DP replicas report as one engine).
    pub fn merge(&mut self, o: &EngineStats) {
        let used = self.kv_usage * self.kv_capacity_tokens as f64 + o.kv_usage * o.kv_capacity_tokens as f64;
        self.kv_capacity_tokens += o.kv_capacity_tokens;
        self.kv_usage = if self.kv_capacity_tokens == 0 { 0.0 } else { used / self.kv_capacity_tokens as f64 };
        self.running += o.running;
        self.waiting += o.waiting;
        self.ranks.extend(o.ranks.iter().cloned());
        self.prompt_tokens_total += o.prompt_tokens_total;
        self.generation_tokens_total += o.generation_tokens_total;
        self.finished_stop += o.finished_stop;
        self.finished_length += o.finished_length;
        self.finished_abort += o.finished_abort;
        self.preemptions_total += o.preemptions_total;
        self.prefix_cache_queries += o.prefix_cache_queries;
        self.prefix_cache_hits += o.prefix_cache_hits;
        let r = &o.routing;
        self.routing.prefix += r.prefix;
        self.routing.balance += r.balance;
        self.routing.tie += r.tie;
        self.routing.least_loaded += r.least_loaded;
        self.structured_masks.merge(&o.structured_masks);
        self.steps.merge(&o.steps);
        self.spec.merge(&o.spec);
        self.time_to_first_token.merge(&o.time_to_first_token);
        self.inter_token_latency.merge(&o.inter_token_latency);
        self.e2e_latency.merge(&o.e2e_latency);
        self.queue_time.merge(&o.queue_time);
        self.iteration_tokens.merge(&o.iteration_tokens);
        self.requests.merge(&o.requests);
    }
}

/// Structured-output masks since start: how many, in how many steps, and the engine thread's
/// time computing them. That time overlaps the device's forward pass (the sampler waits only for
/// whatever is left of it), so per step it is the most a constrained step can lose.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MaskStats {
    pub masks: u64,
    pub steps: u64,
    pub seconds: f64,
}

impl MaskStats {
    pub fn record(&mut self, masks: usize, took: Duration) {
        self.masks += masks as u64;
        self.steps += 1;
        self.seconds += took.as_secs_f64();
    }

    pub fn merge(&mut self, o: &MaskStats) {
        self.masks += o.masks;
        self.steps += o.steps;
        self.seconds += o.seconds;
    }
}

/// Steps since start. A step of a DP-attention group counts once (its ranks run it together)
/// and is as long as its busiest rank, so `balance_sum / group_steps` is the mean of each
/// step's tokens per rank over its busiest rank's (TensorRT-LLM's balance ratio): 1 when every
/// rank feeds as many tokens, 1/N when one rank of N does all the work.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepCounts {
    pub steps: u64,
    /// Steps holding prompt chunks and decode rows together on some rank.
    pub mixed: u64,
    /// Steps of a group of several ranks in which some rank fed tokens.
    pub group_steps: u64,
    pub balance_sum: f64,
}

impl StepCounts {
    /// Records one step that fed `tokens[r]` on rank r.
    pub fn record(&mut self, tokens: &[usize], mixed: bool) {
        self.steps += 1;
        self.mixed += u64::from(mixed);
        let busiest = tokens.iter().copied().max().unwrap_or(0);
        if tokens.len() > 1 && busiest > 0 {
            let mean = tokens.iter().sum::<usize>() as f64 / tokens.len() as f64;
            self.group_steps += 1;
            self.balance_sum += mean / busiest as f64;
        }
    }

    pub fn merge(&mut self, o: &StepCounts) {
        self.steps += o.steps;
        self.mixed += o.mixed;
        self.group_steps += o.group_steps;
        self.balance_sum += o.balance_sum;
    }
}
