//! Routing by prefix across attention ranks (DP attention: one engine, a scheduler per rank)
//! and across replicas (`--dp`: an engine each): conversations find their history on the rank
//! that computed it, evictions are seen, a hot prefix spills over within the balance rule, and
//! every output equals the cache-free reference.

use crate::common;

use common::ranks::Ranks;
use common::*;
use mla_core::{Backend, CacheLayout, SamplingParams};
use mla_engine::{Engine, EngineHandle, RouterConfig, RouterPolicy, RoutingStats};
use std::time::Duration;

const MAX_LEN: usize = 64;

fn history(num_blocks: usize) -> HistoryBackend {
    HistoryBackend::new(CacheLayout { block_size: 4, num_blocks }, MAX_LEN)
}

/// A backend whose steps take 20 ms: two first turns submitted back to back are both routed
/// while the first still runs, however loaded the test machine is (with instant steps, a
/// replica could finish the first before the second was routed, and both went to replica 0).
fn slow_history(num_blocks: usize) -> HistoryBackend {
    let mut backend = history(num_blocks);
    backend.delay = Duration::from_millis(20);
    backend
}

fn config(router: RouterConfig) -> mla_engine::EngineConfig {
    mla_engine::EngineConfig { router, ..engine_config(MAX_LEN) }
}

fn least_loaded() -> RouterConfig {
    RouterConfig { policy: RouterPolicy::LeastLoaded, ..RouterConfig::default() }
}

/// Runs `prompt` greedily for `max` tokens, checks the output against the reference and returns
/// it with the prompt tokens the cache held.
fn turn(engine: &EngineHandle, prompt: &[u32], max: usize) -> (Vec<u32>, usize) {
    let greedy = SamplingParams::greedy();
    let mut s = engine.submit(request(prompt.to_vec(), greedy.clone(), None, max)).unwrap();
    let c = collect(&mut s, 1);
    assert_eq!(c.error, None);
    assert_eq!(c.tokens[0], reference(prompt, 0, &greedy, 0, max, &[], MAX_LEN));
    (c.tokens[0].clone(), c.cached_tokens.expect("every request is admitted"))
}

fn idle(engine: &EngineHandle) {
    wait_until("every rank idle", || engine.stats().ranks.iter().all(|r| r.load_tokens == 0 && r.running == 0));
}

/// The scenario: two conversations start at once (so they land on different ranks),
/// then each sends its second turn alone. Returns the prompt tokens each second turn found.
fn two_conversations(engine: &EngineHandle) -> Vec<usize> {
    let greedy = SamplingParams::greedy();
    let first: Vec<Vec<u32>> = (0..2).map(|c| (0..13).map(|i| (c * 29 + i * 5) % 60 + 1).collect()).collect();
    let mut streams: Vec<_> =
        first.iter().map(|p| engine.submit(request(p.clone(), greedy.clone(), None, 6)).unwrap()).collect();
    let replies: Vec<Vec<u32>> = streams.iter_mut().map(|s| collect(s, 1).tokens.remove(0)).collect();
    idle(engine);
    let mut cached = Vec::new();
    for (p, reply) in first.iter().zip(&replies) {
        assert_eq!(*reply, reference(p, 0, &greedy, 0, 6, &[], MAX_LEN));
        let second: Vec<u32> = p.iter().chain(reply).copied().chain([7, 8, 9]).collect();
        cached.push(turn(engine, &second, 4).1);
        idle(engine);
    }
    cached
}

// Each first turn computes 13 prompt tokens and feeds 5 of its 6 outputs: 18 tokens, 4 full
// blocks of 4. The second turn (22 tokens) may take 5 blocks; its rank holds 4 if it is the one
// that computed the first turn, none otherwise.
const HISTORY: usize = 16;

#[test]
fn dp_attention_sends_each_turn_to_the_rank_holding_its_history() {
    let backends = vec![slow_history(64), slow_history(64)];
    let engine = Engine::start(Box::new(Ranks::new(backends)), config(RouterConfig::default())).unwrap();
    assert_eq!(two_conversations(&engine), vec![HISTORY, HISTORY]);
    // First turns: nothing cached anywhere, a tie; second turns: by prefix.
    assert_eq!(engine.stats().routing, RoutingStats { prefix: 2, balance: 0, tie: 2, least_loaded: 0 });
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn replicas_send_each_turn_to_the_replica_holding_its_history() {
    let backends: Vec<Box<dyn Backend>> = vec![Box::new(slow_history(64)), Box::new(slow_history(64))];
    let engine = Engine::start_replicas(backends, config(RouterConfig::default())).unwrap();
    assert_eq!(two_conversations(&engine), vec![HISTORY, HISTORY]);
    let stats = engine.stats();
    assert_eq!(stats.routing.prefix, 2);
    // Each replica served one conversation: half its prompt tokens were found the second time.
    let per_rank: Vec<(u64, u64)> = stats.ranks.iter().map(|r| (r.prefix_cache_queries, r.prefix_cache_hits)).collect();
    assert_eq!(per_rank, vec![(13 + 22, HISTORY as u64); 2]);
    engine.shutdown(Duration::from_secs(1));
}

/// The baseline the issue measured: with the ranks idle, both second turns go to rank 0 and the
/// second conversation's history, on rank 1, is not found.
#[test]
fn least_loaded_routing_finds_only_the_first_ranks_history() {
    let engine =
        Engine::start(Box::new(Ranks::new(vec![slow_history(64), slow_history(64)])), config(least_loaded())).unwrap();
    assert_eq!(two_conversations(&engine), vec![HISTORY, 0]);
    assert_eq!(engine.stats().routing, RoutingStats { least_loaded: 4, ..RoutingStats::default() });
    engine.shutdown(Duration::from_secs(1));
}

/// The router reads the caches themselves: once other prompts have evicted a conversation's
/// blocks, its next turn is a tie, not a prefix decision for a history that is gone.
#[test]
fn evicted_history_is_not_routed_to() {
    let engine =
        Engine::start(Box::new(Ranks::new(vec![history(16), history(16)])), config(RouterConfig::default())).unwrap();
    let first: Vec<u32> = (0..13).map(|i| (i * 5) % 60 + 1).collect();
    let (reply, _) = turn(&engine, &first, 6);
    idle(&engine);
    let second: Vec<u32> = first.iter().chain(&reply).copied().chain([7, 8, 9]).collect();
    // Alone and with nothing cached, each filler goes to rank 0 (the lowest of equal loads) and
    // takes 6 of its 16 blocks: the third evicts the oldest, the conversation's.
    for f in 0..4u32 {
        let filler: Vec<u32> = (0..20).map(|i| (f * 13 + i * 7) % 60 + 1).collect();
        turn(&engine, &filler, 4);
        idle(&engine);
    }
    let before = engine.stats().routing;
    let (_, cached) = turn(&engine, &second, 4);
    let after = engine.stats().routing;
    assert_eq!(cached, 0);
    assert_eq!((after.tie - before.tie, after.prefix - before.prefix), (1, 0));
    engine.shutdown(Duration::from_secs(1));
}

/// A burst of requests sharing a prefix that only rank 0 holds. Without the balance rule they
/// would all go to rank 0; with it (40 tokens, 1.5x) rank 0 takes requests until it carries
/// more than 40 tokens over rank 1 and more than 1.5 times its load, then rank 1 does.
#[test]
fn a_hot_prefix_spills_to_the_other_rank_under_the_balance_rule() {
    let mut backends = vec![history(64), history(64)];
    // Slow steps: the burst is routed before any of it ends, so the loads only grow.
    backends.iter_mut().for_each(|b| b.delay = Duration::from_millis(20));
    let rule = RouterConfig { balance_abs_tokens: Some(40), ..RouterConfig::default() };
    let engine = Engine::start(Box::new(Ranks::new(backends)), config(rule)).unwrap();
    let hot: Vec<u32> = (0..16).map(|i| (i * 3) % 60 + 1).collect();
    let with_suffix = |s: u32| -> Vec<u32> { hot.iter().copied().chain((0..4).map(|i| s * 4 + i + 1)).collect() };
    turn(&engine, &with_suffix(0), 4);
    idle(&engine);
    let greedy = SamplingParams::greedy();
    let prompts: Vec<Vec<u32>> = (1..=10).map(with_suffix).collect();
    let mut streams: Vec<_> =
        prompts.iter().map(|p| engine.submit(request(p.clone(), greedy.clone(), None, 4)).unwrap()).collect();
    // Each costs 24 tokens. Rank 0 (holding the 4 blocks of the hot prefix) takes 24, 48; at 48
    // against 0 it is over both gaps, so rank 1 takes 24; then 72:24, 72:48, 96:48, 96:72,
    // 120:72, 120:96, 144:96: six requests for rank 0, four for rank 1, every other one by the
    // balance rule.
    let routing = engine.stats().routing;
    assert_eq!((routing.prefix, routing.balance), (6, 4));
    for (s, p) in streams.iter_mut().zip(&prompts) {
        let c = collect(s, 1);
        assert_eq!(c.tokens[0], reference(p, 0, &greedy, 0, 4, &[], MAX_LEN));
    }
    idle(&engine);
    let admitted: Vec<u64> = engine.stats().ranks.iter().map(|r| r.prefix_cache_queries / 20).collect();
    assert_eq!(admitted, vec![1 + 6, 4]);
    // Rank 1 has computed the hot prefix by now: the two tie, and the least loaded takes it.
    let before = engine.stats().routing;
    turn(&engine, &with_suffix(11), 4);
    assert_eq!(engine.stats().routing.tie - before.tie, 1);
    engine.shutdown(Duration::from_secs(1));
}
