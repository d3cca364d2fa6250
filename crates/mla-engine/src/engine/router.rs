//! Where a new request goes among the attention ranks of every replica (numbered replica by
//! replica, the order of `EngineStats::ranks`). Runs on the submitting thread, before the
//! request reaches an engine thread, so it never delays a step.
//!
//! Work is counted in tokens a request may hold (`n · (prompt + max_tokens)`), not in requests,
//! so one long prompt weighs as much as the many short ones it displaces.
//!
//! `RouterPolicy::Prefix` looks the prompt's chain of block hashes up in every rank's cache
//! (`CacheIndex`, exact, evictions included) and sends the request to the rank holding the
//! longest cached prefix, the least loaded of those holding as much; when no rank holds more
//! than another it is a tie, and the least-loaded rank takes it. The balance rule (SGLang's
//! shape: an absolute and a relative gap, both exceeded) passes over a prefix holder that
//! already carries more work than the least-loaded rank, so a hot prefix cannot pile every
//! request onto one rank: the least-loaded rank computes the prefix too, and from then on the
//! two tie. The gaps are measured before the request is counted, so a lone long request on
//! idle ranks still goes to its history. `RouterPolicy::LeastLoaded` never looks at caches.

use super::rank_loads::RankLoads;
use crate::api::{GenerateRequest, RouterConfig, RouterPolicy};
use crate::cache_index::{CacheIndex, CachePublisher};
use crate::prefix_hash::{BlockHash, PrefixHasher};
use crate::scheduler::reusable_blocks;
use crate::stats::RoutingStats;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a request went where it did (`RoutingStats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The rank holding the longest cached prefix.
    Prefix,
    /// The least-loaded rank, because the prefix holder had too much work (the balance rule).
    Balance,
    /// The least-loaded rank: no rank held more of the prefix than another.
    Tie,
    /// The least-loaded rank under `RouterPolicy::LeastLoaded`.
    LeastLoaded,
}

/// What the router knows of one rank: its load (`None`: its engine stopped, never chosen) and
/// how many leading blocks of the prompt it caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RankState {
    pub load: Option<u64>,
    pub cached_blocks: usize,
}

/// When the rank holding the longest prefix is passed over: its load exceeds the least-loaded
/// rank's by more than `abs_tokens` and is more than `rel` times it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct BalanceRule {
    pub abs_tokens: u64,
    pub rel: f64,
}

impl BalanceRule {
    fn overloaded(&self, holder: u64, least: u64) -> bool {
        holder.saturating_sub(least) > self.abs_tokens && holder as f64 > self.rel * least as f64
    }
}

/// The index of the smallest load; ties go to the lowest index so routing is deterministic.
/// Entries that are `None` (a replica that stopped) are never chosen; `None` when all are.
pub(crate) fn least_loaded_of(loads: impl IntoIterator<Item = Option<u64>>) -> Option<usize> {
    let mut best: Option<(usize, u64)> = None;
    for (i, load) in loads.into_iter().enumerate() {
        if let Some(l) = load {
            if best.is_none_or(|(_, b)| l < b) {
                best = Some((i, l));
            }
        }
    }
    best.map(|(i, _)| i)
}

/// The prefix policy's choice; `None` when every rank stopped.
pub(crate) fn by_prefix(ranks: &[RankState], rule: BalanceRule) -> Option<(usize, Reason)> {
    let least = least_loaded_of(ranks.iter().map(|r| r.load))?;
    let live = || ranks.iter().enumerate().filter_map(|(i, r)| r.load.map(|l| (i, l, r.cached_blocks)));
    let longest = live().map(|(_, _, c)| c).max()?;
    if live().all(|(_, _, c)| c == longest) {
        return Some((least, Reason::Tie));
    }
    let (holder, load, _) =
        live().filter(|&(_, _, c)| c == longest).min_by_key(|&(i, l, _)| (l, i)).expect("the longest is held");
    let least_load = ranks[least].load.expect("the least loaded rank is live");
    if holder != least && rule.overloaded(load, least_load) {
        Some((least, Reason::Balance))
    } else {
        Some((holder, Reason::Prefix))
    }
}

/// Decisions by reason, since start.
#[derive(Debug, Default)]
struct Counters([AtomicU64; 4]);

impl Counters {
    fn count(&self, reason: Reason) {
        self.0[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn get(&self, reason: Reason) -> u64 {
        self.0[reason as usize].load(Ordering::Relaxed)
    }
}

/// What one rank's scheduler needs so the router sees its cache: the engine's hasher and the
/// rank's end of the index.
pub(crate) struct RankCache {
    pub hasher: PrefixHasher,
    pub publisher: CachePublisher,
}

/// The prefix policy's state: every rank's cached hashes and the keys they are hashed with.
struct PrefixLookup {
    index: CacheIndex,
    hasher: PrefixHasher,
    block_size: usize,
    rule: BalanceRule,
}

/// Chooses an attention rank for each request; shared by every clone of the handle.
pub(crate) struct Router {
    prefix: Option<PrefixLookup>,
    counters: Counters,
}

/// Where a request goes, and its prompt's block hashes when the router worked them out (the
/// rank's scheduler takes them instead of hashing the prompt again).
#[derive(Debug)]
pub(crate) struct Routed {
    pub rank: usize,
    pub hashes: Vec<BlockHash>,
}

impl Router {
    /// A router over `ranks` attention ranks with caches of `block_size`-token blocks, and for
    /// each rank what its scheduler needs (none under the least-loaded policy).
    pub fn new(
        cfg: &RouterConfig,
        prefix_caching: bool,
        ranks: usize,
        block_size: usize,
    ) -> anyhow::Result<(Router, Vec<Option<RankCache>>)> {
        let counters = Counters::default();
        if cfg.policy == RouterPolicy::LeastLoaded || ranks == 1 {
            if ranks > 1 {
                tracing::info!("routing over {ranks} attention ranks: to the least loaded");
            }
            return Ok((Router { prefix: None, counters }, (0..ranks).map(|_| None).collect()));
        }
        anyhow::ensure!(
            prefix_caching,
            "the prefix router policy needs prefix caching; route by least-loaded without it"
        );
        anyhow::ensure!(
            cfg.balance_rel.is_finite() && cfg.balance_rel >= 1.0,
            "the router's relative balance threshold must be at least 1, got {}",
            cfg.balance_rel
        );
        let rule = BalanceRule {
            abs_tokens: cfg.balance_abs_tokens.unwrap_or(DEFAULT_BALANCE_ABS_TOKENS),
            rel: cfg.balance_rel,
        };
        tracing::info!(
            "routing over {ranks} attention ranks: to the longest cached prefix, or to the least loaded when the \
             prefix's rank carries over {} tokens more work and over {}x as much",
            rule.abs_tokens,
            rule.rel
        );
        let hasher = PrefixHasher::default();
        let (index, publishers) = CacheIndex::new(ranks);
        let caches =
            publishers.into_iter().map(|publisher| Some(RankCache { hasher: hasher.clone(), publisher })).collect();
        Ok((Router { prefix: Some(PrefixLookup { index, hasher, block_size, rule }), counters }, caches))
    }

    /// The rank for `req` given every rank's load (`None`: stopped); `None` when all stopped.
    pub fn route(&self, req: &GenerateRequest, loads: &[Option<u64>]) -> Option<Routed> {
        if loads.len() == 1 {
            return loads[0].map(|_| Routed { rank: 0, hashes: Vec::new() });
        }
        // A request that wants prompt logprobs computes its whole prompt wherever it goes.
        let Some(p) = self.prefix.as_ref().filter(|_| req.prompt_logprobs.is_none()) else {
            let rank = least_loaded_of(loads.iter().copied())?;
            let reason = if self.prefix.is_some() { Reason::Tie } else { Reason::LeastLoaded };
            self.counters.count(reason);
            return Some(Routed { rank, hashes: Vec::new() });
        };
        let prompt = &req.prompt_tokens;
        let mut hashes = Vec::new();
        p.hasher.extend(&mut hashes, prompt, reusable_blocks(prompt.len(), p.block_size) * p.block_size, p.block_size);
        let cached = p.index.cached_prefixes(&hashes);
        let ranks: Vec<RankState> =
            loads.iter().zip(cached).map(|(&load, cached_blocks)| RankState { load, cached_blocks }).collect();
        let (rank, reason) = by_prefix(&ranks, p.rule)?;
        self.counters.count(reason);
        Some(Routed { rank, hashes })
    }

    pub fn stats(&self) -> RoutingStats {
        let c = &self.counters;
        RoutingStats {
            prefix: c.get(Reason::Prefix),
            balance: c.get(Reason::Balance),
            tie: c.get(Reason::Tie),
            least_loaded: c.get(Reason::LeastLoaded),
        }
    }
}

/// The balance rule's absolute gap when none is given, in tokens of work. Measured on four
/// H100s (V2-Lite shape, --max-num-batched-tokens 8192, DP attention and --dp 4; run X9 of
/// 2026-11-27): 64 chats of 8 turns with 2 s between turns found 0.667 of their prompts cached
/// at a gap of 8,192 tokens, 0.734 at 16,384, 0.794 (all there is, one GPU's rate) at 32,768
/// and 65,536, because at light load one rank easily carries 1.5x another's work and the rule
/// sent turns away from their history; a single shared 2,000-token prefix (500 requests at
/// concurrency 64) lost throughput as the gap grew (7,706, 7,545, 7,428 tok/s at 16k, 32k,
/// 64k), because the prefix's rank takes that much work before another computes the prefix
/// too. 32,768 keeps every turn's history and costs a hot prefix about 2-4%. An eighth of the
/// KV cache (the first default, 150k tokens there) never balanced at all.
const DEFAULT_BALANCE_ABS_TOKENS: u64 = 32_768;

/// The loads of every rank of every replica, in rank order (`None` for a replica that stopped).
pub(crate) fn live_loads<'a>(replicas: impl Iterator<Item = (&'a RankLoads, bool)>) -> Vec<Option<u64>> {
    replicas.flat_map(|(loads, alive)| (0..loads.len()).map(move |r| alive.then(|| loads.get(r)))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranks(states: &[(u64, usize)]) -> Vec<RankState> {
        states.iter().map(|&(l, c)| RankState { load: Some(l), cached_blocks: c }).collect()
    }

    const RULE: BalanceRule = BalanceRule { abs_tokens: 100, rel: 1.5 };

    #[test]
    fn least_loaded_picks_the_smallest_load_and_the_lowest_index_on_ties() {
        let of = |l: &[u64]| least_loaded_of(l.iter().map(|&x| Some(x)));
        assert_eq!(of(&[5]), Some(0));
        assert_eq!(of(&[7, 3, 9]), Some(1));
        assert_eq!(of(&[4, 4, 4]), Some(0));
        assert_eq!(of(&[9, 2, 2, 1, 1]), Some(3));
        assert_eq!(least_loaded_of([None, Some(10), Some(3)]), Some(2));
        assert_eq!(least_loaded_of([Some(0), None]), Some(0));
        assert_eq!(least_loaded_of([None, None]), None);
        assert_eq!(least_loaded_of(Vec::<Option<u64>>::new()), None);
    }

    /// Requests of equal cost spread round-robin; a heavy one is balanced by several light ones.
    #[test]
    fn routing_by_tokens_balances_uneven_requests() {
        let mut loads = vec![0u64; 2];
        for cost in [1000, 100, 100, 100, 100] {
            let r = least_loaded_of(loads.iter().map(|&l| Some(l))).unwrap();
            loads[r] += cost;
        }
        assert_eq!(loads, vec![1000, 400]);
    }

    #[test]
    fn the_longest_prefix_wins_and_equal_prefixes_go_to_the_least_loaded() {
        // Rank 2 holds 3 blocks, more than anyone: it gets the request though it is busier.
        assert_eq!(by_prefix(&ranks(&[(10, 0), (0, 1), (50, 3)]), RULE), Some((2, Reason::Prefix)));
        // Ranks 1 and 2 hold 3 blocks each: the less loaded of them.
        assert_eq!(by_prefix(&ranks(&[(0, 0), (60, 3), (50, 3)]), RULE), Some((2, Reason::Prefix)));
        assert_eq!(by_prefix(&ranks(&[(0, 0), (50, 3), (50, 3)]), RULE), Some((1, Reason::Prefix)));
        // Nobody holds more than another: a tie, the least loaded takes it.
        assert_eq!(by_prefix(&ranks(&[(30, 0), (20, 0)]), RULE), Some((1, Reason::Tie)));
        assert_eq!(by_prefix(&ranks(&[(30, 2), (20, 2)]), RULE), Some((1, Reason::Tie)));
        // The least-loaded rank holding the longest prefix is a prefix decision, not a tie.
        assert_eq!(by_prefix(&ranks(&[(30, 0), (20, 2)]), RULE), Some((1, Reason::Prefix)));
    }

    #[test]
    fn the_balance_rule_needs_both_gaps() {
        // 300 against 100: 200 apart (> 100) and 3x (> 1.5x): the least loaded takes it.
        assert_eq!(by_prefix(&ranks(&[(300, 4), (100, 0)]), RULE), Some((1, Reason::Balance)));
        // 101 against 0: more than 100 apart, and any load is more than 1.5 times none.
        assert_eq!(by_prefix(&ranks(&[(101, 4), (0, 0)]), RULE), Some((1, Reason::Balance)));
        // Only the absolute gap: 1100 against 1000 is 1.1x.
        assert_eq!(by_prefix(&ranks(&[(1100, 4), (1000, 0)]), RULE), Some((0, Reason::Prefix)));
        // Only the relative gap: 90 against 10 is 80 apart.
        assert_eq!(by_prefix(&ranks(&[(90, 4), (10, 0)]), RULE), Some((0, Reason::Prefix)));
        // Idle ranks: however long the request, its history wins (the rule looks at loads
        // before the request is counted).
        assert_eq!(by_prefix(&ranks(&[(0, 4), (0, 0)]), RULE), Some((0, Reason::Prefix)));
        // The balance rule compares with the least-loaded rank, wherever it is.
        assert_eq!(by_prefix(&ranks(&[(500, 0), (400, 4), (200, 1)]), RULE), Some((2, Reason::Balance)));
    }

    #[test]
    fn stopped_ranks_are_never_chosen_and_do_not_count_as_holders() {
        let mut r = ranks(&[(0, 5), (40, 1), (20, 1)]);
        r[0].load = None;
        assert_eq!(by_prefix(&r, RULE), Some((2, Reason::Tie)));
        r[1].cached_blocks = 2;
        assert_eq!(by_prefix(&r, RULE), Some((1, Reason::Prefix)));
        r.iter_mut().for_each(|s| s.load = None);
        assert_eq!(by_prefix(&r, RULE), None);
    }

    /// A burst of requests for one hot prefix, cached on rank 0 only, onto two idle ranks: rank
    /// 0 takes them until it carries more than the absolute gap over rank 1, and from then on
    /// never more than the larger of the two gaps (plus the request that crossed it).
    #[test]
    fn a_hot_prefix_on_one_rank_spills_within_the_rule() {
        let cost = 30;
        let mut loads = [0u64, 0];
        for i in 0..40 {
            let (r, _) = by_prefix(&ranks(&[(loads[0], 8), (loads[1], 0)]), RULE).unwrap();
            loads[r] += cost;
            // 0, 30, 60, 90, 120 on rank 0: only then more than 100 apart.
            assert_eq!(loads[1] == 0, i < 4, "request {i}: {loads:?}");
            let bound = (loads[1] + RULE.abs_tokens).max((RULE.rel * loads[1] as f64) as u64) + cost;
            assert!(loads[0] <= bound, "request {i}: {loads:?}");
        }
        // 1200 tokens in all: the relative gap holds them at 3:2 at most.
        assert!(loads[1] >= 1200 * 2 / 5 - cost, "{loads:?}");
    }
}
