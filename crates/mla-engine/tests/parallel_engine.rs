//! The engine over several attention ranks (DP attention: one backend, a scheduler and cache per
//! rank, lockstep steps) and over several replicas (`--dp`: one engine thread per backend):
//! outputs against the cache-free reference, routing by load, statistics per rank, and a
//! backend that dies.

use crate::common;

use common::ranks::Ranks;
use common::*;
use mla_core::{Backend, CacheLayout, SamplingParams};
use mla_engine::{Engine, EngineHandle, FinishReason, SubmitError};
use std::time::Duration;

const MAX_LEN: usize = 64;

fn history(num_blocks: usize) -> HistoryBackend {
    HistoryBackend::new(CacheLayout { block_size: 4, num_blocks }, MAX_LEN)
}

/// Submits prompts of uneven lengths at once, checks every greedy output and that every
/// block came back; returns the statistics.
fn serve_all(engine: &EngineHandle, count: usize) -> mla_engine::EngineStats {
    let greedy = SamplingParams::greedy();
    // Uneven work: every third request is long, so ranks prefill while others decode.
    let reqs: Vec<(Vec<u32>, usize)> =
        prompts(count).into_iter().enumerate().map(|(i, p)| (p, if i % 3 == 0 { 30 } else { 5 })).collect();
    let mut streams: Vec<_> =
        reqs.iter().map(|(p, max)| engine.submit(request(p.clone(), greedy.clone(), None, *max)).unwrap()).collect();
    for (i, (s, (p, max))) in streams.iter_mut().zip(&reqs).enumerate() {
        let c = collect(s, 1);
        assert_eq!((c.error.as_deref(), c.finish[0]), (None, Some(FinishReason::Length)), "request {i}");
        assert_eq!(c.tokens[0], reference(p, 0, &greedy, 0, *max, &[], MAX_LEN), "request {i}");
    }
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    engine.stats()
}

#[test]
fn dp_attention_ranks_serve_their_own_requests_in_lockstep() {
    let ranks = Ranks::new(vec![history(64), history(64), history(64)]);
    let shapes = ranks.shapes.clone();
    let engine = Engine::start(Box::new(ranks), engine_config(MAX_LEN)).unwrap();
    let stats = serve_all(&engine, 7);
    assert_eq!(stats.ranks.len(), 3);
    assert_eq!(stats.kv_capacity_tokens, 3 * 64 * 4);
    assert!(stats.ranks.iter().all(|r| r.kv_capacity_tokens == 256 && r.load_tokens == 0 && r.running == 0));
    let shapes = shapes.lock().unwrap();
    assert!(shapes.iter().all(|s| s.len() == 3), "every step has a plan for every rank");
    for rank in 0..3 {
        assert!(shapes.iter().any(|s| s[rank] > 0), "rank {rank} got no work");
    }
    assert!(shapes.iter().any(|s| s.contains(&0)), "no step had an idle rank; the test lost its point");
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn requests_go_to_the_rank_with_the_least_tokens_of_work() {
    let gate = std::sync::Arc::new(StepGate::default());
    let mut backends = vec![history(64), history(64)];
    backends[0].gate = Some(gate.clone());
    let engine = Engine::start(Box::new(Ranks::new(backends)), engine_config(MAX_LEN)).unwrap();
    let greedy = SamplingParams::greedy();
    // One heavy request (10 + 40 tokens), then four light ones (3 + 2): the heavy one takes rank
    // 0, every light one goes to rank 1, whose load stays below 50.
    let mut streams = vec![engine.submit(request(vec![1; 10], greedy.clone(), None, 40)).unwrap()];
    streams.extend((0..4).map(|i| engine.submit(request(vec![2 + i; 3], greedy.clone(), None, 2)).unwrap()));
    gate.wait_parked_at(1);
    let loads: Vec<u64> = engine.stats().ranks.iter().map(|r| r.load_tokens).collect();
    assert_eq!(loads, vec![50, 20]);
    gate.open();
    for s in &mut streams {
        assert_eq!(collect(s, 1).error, None);
    }
    engine.shutdown(Duration::from_secs(1));
}

/// DP-attention ranks step together, so a rank that prefills makes the decoding ranks wait: the
/// engine lines up the ranks' prefill turns instead of letting each alternate on its own.
#[test]
fn ranks_take_their_prefill_turns_together() {
    use mla_core::StepKind::{Decode, Prefill};
    let gate = std::sync::Arc::new(StepGate::default());
    let mut backends = vec![history(64), history(64)];
    backends[0].gate = Some(gate.clone());
    let ranks = Ranks::new(backends);
    let kinds = ranks.kinds.clone();
    let engine = Engine::start(Box::new(ranks), engine_config(MAX_LEN)).unwrap();
    let greedy = SamplingParams::greedy();
    let submit = |p: Vec<u32>| engine.submit(request(p, greedy.clone(), None, 30)).unwrap();
    // One long decode on each rank.
    let mut streams = vec![submit(vec![1, 2, 3]), submit(vec![4, 5, 6])];
    gate.allow(3);
    gate.wait_parked_at(4);
    assert_eq!(kinds.lock().unwrap()[..3], [[Some(Prefill); 2], [Some(Decode); 2], [Some(Decode); 2]]);
    // A prompt for one rank: it prefills while the other decodes (nothing to line up yet).
    // Step 4 was built before it came (the engine builds a step before the previous one ends).
    streams.push(submit(vec![7, 8, 9]));
    gate.allow(1);
    gate.wait_parked_at(5);
    let mixed = kinds.lock().unwrap()[4].clone();
    assert!(mixed.contains(&Some(Prefill)) && mixed.contains(&Some(Decode)), "{mixed:?}");
    // A prompt for the other rank right after: left alone that rank would prefill now (its
    // last step decoded) while the first decodes; lined up, this is everyone's decode turn
    // (with many arrivals, the prompts of all ranks then share prefill turns).
    streams.push(submit(vec![10, 11, 12]));
    gate.allow(1);
    gate.wait_parked_at(6);
    assert_eq!(kinds.lock().unwrap()[5], [Some(Decode); 2]);
    gate.allow(1);
    gate.wait_parked_at(7);
    // The next prefill turn: the second prompt's rank prefills; the first has none left.
    assert_eq!(kinds.lock().unwrap()[6], [Some(Decode), Some(Prefill)]);
    gate.open();
    for s in &mut streams {
        assert_eq!(collect(s, 1).error, None);
    }
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn replicas_behind_one_handle_balance_and_report_as_one_engine() {
    let backends: Vec<Box<dyn Backend>> = vec![Box::new(history(64)), Box::new(history(16))];
    let engine = Engine::start_replicas(backends, engine_config(MAX_LEN)).unwrap();
    let stats = serve_all(&engine, 8);
    assert_eq!(stats.ranks.len(), 2);
    assert_eq!(stats.kv_capacity_tokens, (64 + 16) * 4);
    assert_eq!(stats.finished_length, 8);
    assert_eq!(stats.time_to_first_token.count, 8, "histograms of both replicas are merged");
    assert_eq!(stats.prompt_tokens_total, (3..11).sum::<u64>());
    // A request must fit the smallest cache, since it may be routed to either replica.
    let mut r = request(vec![1; 62], SamplingParams::greedy(), None, 1);
    r.n = 4;
    assert!(matches!(engine.submit(r), Err(SubmitError::ExceedsCache { capacity: 16, .. })));
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn a_fatal_backend_error_fails_every_request_and_marks_the_engine_dead() {
    let mut ranks = Ranks::new(vec![history(64), history(64)]);
    ranks.fatal_at = Some(3);
    let engine = Engine::start(Box::new(ranks), engine_config(MAX_LEN)).unwrap();
    // The engine steps while the test submits: on a loaded machine rank 1 can die before the
    // last submissions, which are then refused as Unavailable (not accepted, so not answered).
    let mut streams: Vec<_> = prompts(4)
        .into_iter()
        .filter_map(|p| match engine.submit(request(p, SamplingParams::greedy(), None, 20)) {
            Ok(s) => Some(s),
            Err(SubmitError::Unavailable(why)) if why.contains("rank 1 died") => None,
            Err(e) => panic!("{e:?}"),
        })
        .collect();
    assert!(!streams.is_empty(), "the first request is accepted before any step runs");
    for s in &mut streams {
        let c = collect(s, 1);
        let error = c.error.expect("every accepted request is answered with an error");
        assert!(error.contains("rank 1 died at step 3"), "{error}");
    }
    wait_until("the engine marked dead", || engine.fatal_error().is_some());
    assert!(engine.fatal_error().unwrap().contains("cannot continue"));
    let after = engine.submit(request(vec![1, 2], SamplingParams::greedy(), None, 2));
    assert!(matches!(after, Err(SubmitError::Unavailable(ref why)) if why.contains("rank 1 died")), "{after:?}");
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn a_request_failing_on_one_rank_leaves_the_other_ranks_requests_alone() {
    let mut backends = vec![history(64), history(64)];
    backends[1].poison = Some(59);
    let engine = Engine::start(Box::new(Ranks::new(backends)), engine_config(MAX_LEN)).unwrap();
    let greedy = SamplingParams::greedy();
    // Equal costs: the first goes to rank 0, the second (poisoned) to rank 1.
    let mut good = engine.submit(request(vec![5, 6, 7], greedy.clone(), None, 6)).unwrap();
    let mut bad = engine.submit(request(vec![59, 6, 7], greedy.clone(), None, 6)).unwrap();
    let g = collect(&mut good, 1);
    assert_eq!(g.error, None);
    assert_eq!(g.tokens[0], reference(&[5, 6, 7], 0, &greedy, 0, 6, &[], MAX_LEN));
    let b = collect(&mut bad, 1);
    assert!(b.error.unwrap().contains("poison token 59"));
    assert_eq!(engine.fatal_error(), None);
    engine.shutdown(Duration::from_secs(1));
}
