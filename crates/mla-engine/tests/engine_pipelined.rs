//! The engine with a backend that runs steps on a thread of its own (`Backend::start_step`, as
//! the CUDA backend does): the next step is started before the previous step's events go out.
//! Outputs, preemption, `n > 1`, stops, aborts, finishes from outside and failures must behave
//! exactly as with a synchronous backend, checked against the cache-free reference.

use crate::common;

use common::*;
use mla_core::{CacheLayout, SamplingParams};
use mla_engine::{Engine, EngineEvent, EngineHandle, FinishReason};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MAX_LEN: usize = 64;

fn start(num_blocks: usize, delay_ms: u64) -> (EngineHandle, Arc<Mutex<Log>>, Arc<std::sync::atomic::AtomicUsize>) {
    start_gated(num_blocks, delay_ms, None)
}

/// With a gate, no step runs until the test opens it (to queue requests before the first step).
fn start_gated(
    num_blocks: usize,
    delay_ms: u64,
    gate: Option<Arc<StepGate>>,
) -> (EngineHandle, Arc<Mutex<Log>>, Arc<std::sync::atomic::AtomicUsize>) {
    let mut b = HistoryBackend::new(CacheLayout { block_size: 4, num_blocks }, MAX_LEN);
    b.delay = Duration::from_millis(delay_ms);
    b.gate = gate;
    let log = b.log.clone();
    let t = Threaded::new(b);
    let started = t.started.clone();
    (Engine::start(Box::new(t), engine_config(MAX_LEN)).unwrap(), log, started)
}

#[test]
fn outputs_with_preemption_and_seeds_equal_the_reference() {
    let params = SamplingParams {
        temperature: 0.9,
        top_k: Some(40),
        top_p: 0.95,
        repetition_penalty: 1.3,
        ..Default::default()
    };
    for (sampling, seeds) in [(SamplingParams::greedy(), [None; 6]), (params, [11, 12, 13, 14, 15, 16].map(Some))] {
        // 16 blocks of 4 hold 64 tokens; six requests growing to ~50 tokens each must preempt.
        // Held until all six are queued, so the preemption does not depend on thread timing.
        let gate = Arc::new(StepGate::default());
        let (engine, log, started) = start_gated(16, 0, Some(gate.clone()));
        let mut streams: Vec<_> = prompts(6)
            .into_iter()
            .zip(seeds)
            .map(|(p, seed)| engine.submit(request(p, sampling.clone(), seed, 40)).unwrap())
            .collect();
        gate.open();
        for (i, (s, p)) in streams.iter_mut().zip(prompts(6)).enumerate() {
            let c = collect(s, 1);
            assert_eq!((c.error.as_deref(), c.finish[0]), (None, Some(FinishReason::Length)));
            assert_eq!(
                c.tokens[0],
                reference(&p, 0, &sampling, seeds[i].unwrap_or(0), 40, &[], MAX_LEN),
                "request {i}"
            );
        }
        wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
        let stats = engine.stats();
        assert!(stats.preemptions_total > 0, "the tiny cache did not force preemption");
        assert_eq!((stats.generation_tokens_total, stats.finished_length), (240, 6));
        assert_eq!(
            (stats.time_to_first_token.count, stats.e2e_latency.count, stats.inter_token_latency.count),
            (6, 6, 234)
        );
        assert_eq!(started.load(Ordering::SeqCst), log.lock().unwrap().steps, "every step was started asynchronously");
        engine.shutdown(Duration::from_secs(1));
    }
}

#[test]
fn n_completions_stop_tokens_and_logprobs() {
    let (engine, _, _) = start(256, 0);
    let prompt: Vec<u32> = (0..10u32).map(|i| i * 5 % 60 + 1).collect();
    let params = SamplingParams { temperature: 1.0, ..Default::default() };
    let mut req = request(prompt.clone(), params.clone(), Some(7), 12);
    req.n = 2;
    let c = collect(&mut engine.submit(req).unwrap(), 2);
    for i in 0..2 {
        assert_eq!(c.tokens[i], reference(&prompt, i, &params, 7, 12, &[], MAX_LEN), "completion {i}");
    }
    let greedy = SamplingParams::greedy();
    let full = reference(&prompt, 0, &greedy, 0, 30, &[], MAX_LEN);
    let mut req = request(prompt.clone(), greedy.clone(), None, 30);
    req.stop_token_ids = vec![full[4]];
    req.logprobs = Some(3);
    let c = collect(&mut engine.submit(req).unwrap(), 1);
    let upto = full.iter().position(|&t| t == full[4]).unwrap() + 1;
    assert_eq!((c.tokens[0].as_slice(), c.finish[0]), (&full[..upto], Some(FinishReason::Stop)));
    assert!(c.logprobs[0].iter().all(|l| l.as_ref().is_some_and(|l| l.top.len() == 3)));
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn finishing_one_choice_mid_stream_ends_it_cleanly_and_leaves_the_other_untouched() {
    let (engine, _, _) = start(256, 2);
    let prompt: Vec<u32> = (0..10u32).map(|i| i * 5 % 60 + 1).collect();
    let params = SamplingParams { temperature: 1.0, ..Default::default() };
    let mut req = request(prompt.clone(), params.clone(), Some(7), 30);
    req.n = 2;
    let mut stream = engine.submit(req).unwrap();
    let mut early: Vec<Vec<u32>> = vec![vec![]; 2];
    while early[0].len() < 3 {
        let Some(EngineEvent::Token { index, token, finish: None, .. }) = next_event(&mut stream.events) else {
            panic!("stream ended early")
        };
        early[index].push(token);
    }
    stream.finish_choice(0, FinishReason::Stop);
    // `collect` fails on any token after a completion's finish.
    let mut c = collect(&mut stream, 2);
    for (i, e) in early.into_iter().enumerate() {
        c.tokens[i].splice(0..0, e);
    }
    assert_eq!(c.finish, vec![Some(FinishReason::Stop), Some(FinishReason::Length)]);
    let full0 = reference(&prompt, 0, &params, 7, 30, &[], MAX_LEN);
    // The step in flight and the one applied but not yet delivered may still add a token each.
    let got0 = c.tokens[0].len();
    assert!((3..=5).contains(&got0), "{got0} tokens for the finished choice");
    assert_eq!(c.tokens[0], full0[..got0]);
    assert_eq!(c.tokens[1], reference(&prompt, 1, &params, 7, 30, &[], MAX_LEN), "as if choice 0 had run on");
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    let s = engine.stats();
    assert_eq!((s.finished_stop, s.finished_length, s.finished_abort), (1, 1, 0));
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn aborts_and_dropped_streams_end_cleanly() {
    let (engine, log, _) = start(256, 2);
    let ps = prompts(3);
    let mut req = request(ps[0].clone(), SamplingParams::greedy(), None, 400);
    req.n = 2;
    let mut aborted = engine.submit(req).unwrap();
    let mut gone = engine.submit(request(ps[1].clone(), SamplingParams::greedy(), None, 400)).unwrap();
    let mut keep = engine.submit(request(ps[2].clone(), SamplingParams::greedy(), None, 30)).unwrap();
    assert!(matches!(next_event(&mut aborted.events), Some(EngineEvent::Token { .. })));
    aborted.abort();
    let c = collect(&mut aborted, 2);
    assert_eq!(c.finish, vec![Some(FinishReason::Abort); 2]);
    for _ in 0..3 {
        assert!(matches!(next_event(&mut gone.events), Some(EngineEvent::Token { .. })));
    }
    let (gone_id, steps_at_drop) = (gone.id, log.lock().unwrap().steps);
    drop(gone);
    wait_until("the abort", || engine.stats().finished_abort == 3);
    // The step in flight at the drop, one that may start before the drop lands, and one more
    // started before the departure is noticed.
    let later =
        log.lock().unwrap().seqs[steps_at_drop..].iter().filter(|s| s.iter().any(|&q| q >> 16 == gone_id)).count();
    assert!(later <= 3, "the dropped request ran {later} more steps");
    assert_eq!(collect(&mut keep, 1).tokens[0], reference(&ps[2], 0, &SamplingParams::greedy(), 0, 30, &[], MAX_LEN));
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn a_failed_step_fails_only_the_affected_request() {
    const POISON: u32 = 63;
    let mut b = HistoryBackend::new(CacheLayout { block_size: 4, num_blocks: 256 }, MAX_LEN);
    b.poison = Some(POISON);
    b.delay = Duration::from_millis(30);
    let log = b.log.clone();
    let mut cfg = engine_config(MAX_LEN);
    cfg.max_num_batched_tokens = 64;
    let engine = Engine::start(Box::new(Threaded::new(b)), cfg).unwrap();
    let greedy = SamplingParams::greedy();
    // Keep the engine busy so the next three arrive together and share one prefill step.
    let mut warm = engine.submit(request(vec![1, 2], greedy.clone(), None, 1)).unwrap();
    wait_until("the first step", || log.lock().unwrap().steps == 1);
    let ps = prompts(2);
    let mut ok1 = engine.submit(request(ps[0].clone(), greedy.clone(), None, 6)).unwrap();
    let mut bad = engine.submit(request(vec![5, POISON, 7], greedy.clone(), None, 6)).unwrap();
    let mut ok2 = engine.submit(request(ps[1].clone(), greedy.clone(), None, 6)).unwrap();
    collect(&mut warm, 1);
    let bad_c = collect(&mut bad, 1);
    assert!(bad_c.error.as_deref().is_some_and(|m| m.contains("poison")), "{:?}", bad_c.error);
    assert_eq!(collect(&mut ok1, 1).tokens[0], reference(&ps[0], 0, &greedy, 0, 6, &[], MAX_LEN));
    assert_eq!(collect(&mut ok2, 1).tokens[0], reference(&ps[1], 0, &greedy, 0, 6, &[], MAX_LEN));
    let together = log
        .lock()
        .unwrap()
        .seqs
        .iter()
        .any(|s| [ok1.id, bad.id, ok2.id].iter().all(|&id| s.iter().any(|&q| q >> 16 == id)));
    assert!(together, "the failing step should have batched all three");
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn shutdown_with_a_step_in_flight_aborts_the_rest() {
    let (engine, _, _) = start(256, 3);
    let mut s = engine.submit(request(prompts(1).remove(0), SamplingParams::greedy(), None, 50)).unwrap();
    assert!(matches!(next_event(&mut s.events), Some(EngineEvent::Token { .. })));
    engine.shutdown(Duration::from_millis(10));
    let c = collect(&mut s, 1);
    assert_eq!(c.finish[0], Some(FinishReason::Abort));
    assert_eq!(engine.stats().finished_abort, 1);
    assert_eq!(engine.stats().kv_usage, 0.0);
}
