//! The engine's life: refusals at submission, clients leaving, queue limits, shutdown, errors.

use crate::common;

use common::*;
use mla_core::{CacheLayout, SamplingParams};
use mla_engine::{Engine, EngineEvent, FinishReason, SubmitError};
use std::time::{Duration, Instant};

const MAX_LEN: usize = 512;

fn backend(delay_ms: u64) -> HistoryBackend {
    let mut b = HistoryBackend::new(CacheLayout { block_size: 4, num_blocks: 512 }, MAX_LEN);
    b.delay = Duration::from_millis(delay_ms);
    b
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> mla_engine::GenerateRequest {
    request(prompt, SamplingParams::greedy(), None, max_tokens)
}

fn expect(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    reference(prompt, 0, &SamplingParams::greedy(), 0, max_tokens, &[], MAX_LEN)
}

#[test]
fn handles_and_streams_cross_threads() {
    fn shareable<T: Clone + Send + Sync + 'static>() {}
    fn sendable<T: Send + 'static>() {}
    shareable::<mla_engine::EngineHandle>();
    sendable::<mla_engine::RequestStream>();
}

#[test]
fn dropping_a_stream_aborts_it_within_a_step_and_frees_its_blocks() {
    let b = backend(2);
    let log = b.log.clone();
    let cfg = mla_engine::EngineConfig { mixed_steps: true, max_num_batched_tokens: 64, ..engine_config(MAX_LEN) };
    let engine = Engine::start(Box::new(b), cfg).unwrap();
    let ps = prompts(2);
    let mut keep = engine.submit(greedy(ps[0].clone(), 60)).unwrap();
    let mut gone = engine.submit(greedy(ps[1].clone(), 400)).unwrap();
    let gone_id = gone.id;
    for _ in 0..3 {
        assert!(matches!(next_event(&mut gone.events), Some(EngineEvent::Token { .. })));
    }
    let steps_at_drop = log.lock().unwrap().steps;
    drop(gone);
    wait_until("the abort", || engine.stats().finished_abort == 1);
    // At most the step in flight at the drop, and one that may start before the drop lands.
    let later =
        log.lock().unwrap().seqs[steps_at_drop..].iter().filter(|s| s.iter().any(|&q| q >> 16 == gone_id)).count();
    assert!(later <= 2, "the dropped request ran {later} more steps");
    let c = collect(&mut keep, 1);
    assert_eq!(c.tokens[0], expect(&ps[0], 60), "the other request is unaffected");
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn explicit_abort_reports_finished_abort() {
    let engine = Engine::start(Box::new(backend(1)), engine_config(MAX_LEN)).unwrap();
    let mut req = greedy(prompts(1).remove(0), 400);
    req.n = 2;
    let mut s = engine.submit(req).unwrap();
    assert!(matches!(next_event(&mut s.events), Some(EngineEvent::Token { .. })));
    s.abort();
    let c = collect(&mut s, 2);
    assert_eq!(c.finish, vec![Some(FinishReason::Abort); 2]);
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0 && engine.stats().finished_abort == 2);
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn queue_full_when_max_queued_requests_are_waiting() {
    let mut cfg = engine_config(MAX_LEN);
    (cfg.max_num_seqs, cfg.max_queued_requests) = (1, 1);
    let engine = Engine::start(Box::new(backend(1)), cfg).unwrap();
    let ps = prompts(3);
    let mut running = engine.submit(greedy(ps[0].clone(), 400)).unwrap();
    assert!(matches!(next_event(&mut running.events), Some(EngineEvent::Token { .. })), "first request admitted");
    // The only sequence slot is taken, so this one waits in the queue ...
    let _waiting = engine.submit(greedy(ps[1].clone(), 5)).unwrap();
    // ... and the queue is full.
    assert_eq!(engine.submit(greedy(ps[2].clone(), 5)).err(), Some(SubmitError::QueueFull { limit: 1 }));
    running.abort();
    engine.shutdown(Duration::ZERO);
}

#[test]
fn shutdown_aborts_in_flight_requests_and_refuses_new_ones() {
    let mut cfg = engine_config(MAX_LEN);
    cfg.max_num_seqs = 1;
    let engine = Engine::start(Box::new(backend(2)), cfg).unwrap();
    let ps = prompts(2);
    let mut running = engine.submit(greedy(ps[0].clone(), 400)).unwrap();
    let mut queued = engine.submit(greedy(ps[1].clone(), 400)).unwrap();
    assert!(matches!(next_event(&mut running.events), Some(EngineEvent::Token { .. })));
    let t = Instant::now();
    engine.shutdown(Duration::from_millis(20));
    assert!(t.elapsed() < Duration::from_secs(2), "shutdown waited {:?}", t.elapsed());
    assert_eq!(engine.submit(greedy(ps[0].clone(), 5)).err(), Some(SubmitError::ShuttingDown));
    let (r, q) = (collect(&mut running, 1), collect(&mut queued, 1));
    assert_eq!((r.finish[0], q.finish[0]), (Some(FinishReason::Abort), Some(FinishReason::Abort)));
    assert!(q.tokens[0].is_empty());
    assert_eq!(engine.stats().finished_abort, 2);
}

#[test]
fn shutdown_lets_requests_finish_within_the_grace_period() {
    let engine = Engine::start(Box::new(backend(2)), engine_config(MAX_LEN)).unwrap();
    let p = prompts(1).remove(0);
    let mut s = engine.submit(greedy(p.clone(), 8)).unwrap();
    engine.shutdown(Duration::from_secs(10));
    let c = collect(&mut s, 1);
    assert_eq!((c.tokens[0].clone(), c.finish[0]), (expect(&p, 8), Some(FinishReason::Length)));
}

/// Fed by the poison-token tests: a prompt holding it fails every step it is in.
const POISON: u32 = 63;

/// A backend whose steps fail when fed `POISON`, slow enough (30 ms a step) that requests
/// submitted together share a step.
fn poisoned() -> HistoryBackend {
    let mut b = backend(0);
    b.poison = Some(POISON);
    b.delay = Duration::from_millis(30);
    b
}

/// Whether one logged step held a sequence of every request in `ids`.
fn one_step_held(log: &std::sync::Mutex<Log>, ids: &[u64]) -> bool {
    log.lock().unwrap().seqs.iter().any(|s| ids.iter().all(|&id| s.iter().any(|&q| q >> 16 == id)))
}

#[test]
fn a_backend_error_fails_only_the_affected_request() {
    let b = poisoned();
    let log = b.log.clone();
    let mut cfg = engine_config(MAX_LEN);
    cfg.max_num_batched_tokens = 64;
    let engine = Engine::start(Box::new(b), cfg).unwrap();
    // Keep the engine busy so the next three arrive together and share one prefill step.
    let mut warm = engine.submit(greedy(vec![1, 2], 1)).unwrap();
    wait_until("the first step", || log.lock().unwrap().steps == 1);
    let ps = prompts(2);
    let mut ok1 = engine.submit(greedy(ps[0].clone(), 6)).unwrap();
    let mut bad = engine.submit(greedy(vec![5, POISON, 7], 6)).unwrap();
    let mut ok2 = engine.submit(greedy(ps[1].clone(), 6)).unwrap();
    collect(&mut warm, 1);
    let bad_c = collect(&mut bad, 1);
    assert!(bad_c.error.as_deref().is_some_and(|m| m.contains("poison")), "{:?}", bad_c.error);
    assert!(bad_c.tokens[0].is_empty());
    assert_eq!(collect(&mut ok1, 1).tokens[0], expect(&ps[0], 6));
    assert_eq!(collect(&mut ok2, 1).tokens[0], expect(&ps[1], 6));
    assert!(one_step_held(&log, &[ok1.id, bad.id, ok2.id]), "the failing step should have batched all three");
    // The engine is still serving and nothing leaked.
    let p = prompts(3).remove(2);
    assert_eq!(collect(&mut engine.submit(greedy(p.clone(), 4)).unwrap(), 1).tokens[0], expect(&p, 4));
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    engine.shutdown(Duration::from_secs(1));
}

/// A failed mixed step (prompt chunks beside decode rows) is retried request by request, each
/// part a step of its own kind: the decoding request and the healthy prompt finish, only the
/// poisoned one fails. (The parts once kept the whole step's kind, `Mixed { prefill: 2 }` over
/// one sequence, which every backend refuses: every request of the step failed.)
#[test]
fn a_failed_mixed_step_is_retried_as_steps_of_their_own_kinds() {
    let b = poisoned();
    let log = b.log.clone();
    let cfg = mla_engine::EngineConfig { mixed_steps: true, max_num_batched_tokens: 64, ..engine_config(MAX_LEN) };
    let engine = Engine::start(Box::new(b), cfg).unwrap();
    let ps = prompts(2);
    let mut decoding = engine.submit(greedy(ps[0].clone(), 12)).unwrap();
    wait_until("the first request decodes", || log.lock().unwrap().steps >= 2);
    let mut ok = engine.submit(greedy(ps[1].clone(), 6)).unwrap();
    let mut bad = engine.submit(greedy(vec![5, POISON, 7], 6)).unwrap();
    let bad_c = collect(&mut bad, 1);
    assert!(bad_c.error.as_deref().is_some_and(|m| m.contains("poison")), "{:?}", bad_c.error);
    let d = collect(&mut decoding, 1);
    assert_eq!((d.error, d.tokens[0].clone()), (None, expect(&ps[0], 12)));
    let o = collect(&mut ok, 1);
    assert_eq!((o.error, o.tokens[0].clone()), (None, expect(&ps[1], 6)));
    assert!(
        one_step_held(&log, &[decoding.id, ok.id, bad.id]),
        "the failing step should have held the decode row and both prompts"
    );
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn submissions_are_checked_against_limits() {
    let engine = Engine::start(Box::new(backend(0)), engine_config(64)).unwrap();
    let sub = |prompt_len: usize, n: usize, max_tokens: usize| {
        let mut r = greedy(vec![3; prompt_len], max_tokens);
        r.n = n;
        engine.submit(r).map(|_| ())
    };
    assert_eq!(sub(64, 1, 1), Err(SubmitError::TooLong { prompt: 64, needed: 65, limit: 64 }));
    assert_eq!(sub(63, 1, 500), Ok(()), "a long max_tokens just ends at the limit");
    assert!(matches!(sub(0, 1, 5), Err(SubmitError::Invalid(_))));
    assert!(matches!(sub(5, 0, 5), Err(SubmitError::Invalid(_))));
    assert!(matches!(sub(5, 9, 5), Err(SubmitError::Invalid(_))), "n above max_num_seqs");
    assert!(matches!(engine.submit(greedy(vec![64], 5)), Err(SubmitError::Invalid(_))), "token outside the vocabulary");
    let nan = request(vec![3], SamplingParams { temperature: f32::NAN, ..Default::default() }, None, 5);
    assert!(matches!(engine.submit(nan), Err(SubmitError::Invalid(_))));
    engine.shutdown(Duration::ZERO);

    // 16 blocks of 4: a 60-token prompt with n = 4 needs 14 shared + 4 private blocks.
    let small = HistoryBackend::new(CacheLayout { block_size: 4, num_blocks: 16 }, 64);
    let engine = Engine::start(Box::new(small), engine_config(64)).unwrap();
    let mut r = greedy(vec![3; 60], 2);
    r.n = 4;
    assert_eq!(engine.submit(r).err(), Some(SubmitError::ExceedsCache { blocks: 18, capacity: 16 }));
    engine.shutdown(Duration::ZERO);

    // A cache smaller than one max-length sequence could never finish it.
    let tiny = HistoryBackend::new(CacheLayout { block_size: 4, num_blocks: 15 }, 64);
    let err = Engine::start(Box::new(tiny), engine_config(64)).err().expect("refused");
    assert!(err.to_string().contains("max_model_len"), "{err}");
}
