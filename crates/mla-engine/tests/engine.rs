//! End to end through the engine thread: outputs checked against the cache-free reference.

use crate::common;

use common::*;
use mla_core::sampling::log_softmax;
use mla_core::{CacheLayout, SamplingParams};
use mla_engine::{Engine, EngineHandle, EngineStats, FinishReason};
use std::time::Duration;

const MAX_LEN: usize = 64;

fn start(block_size: usize, num_blocks: usize) -> (EngineHandle, std::sync::Arc<std::sync::Mutex<Log>>) {
    let backend = HistoryBackend::new(CacheLayout { block_size, num_blocks }, MAX_LEN);
    let log = backend.log.clone();
    (Engine::start(Box::new(backend), engine_config(MAX_LEN)).unwrap(), log)
}

/// Submits every request at once and gathers each one's single completion.
/// The engine is held at its first step until all are queued, so the preemption the tiny
/// cache is meant to force does not depend on how fast the submitting thread runs.
fn run_all(num_blocks: usize, sampling: &SamplingParams, seeds: &[Option<u64>]) -> (Vec<Vec<u32>>, EngineStats) {
    let gate = std::sync::Arc::new(StepGate::default());
    let mut backend = HistoryBackend::new(CacheLayout { block_size: 4, num_blocks }, MAX_LEN);
    backend.gate = Some(gate.clone());
    let engine = Engine::start(Box::new(backend), engine_config(MAX_LEN)).unwrap();
    let mut streams: Vec<_> = prompts(seeds.len())
        .into_iter()
        .zip(seeds)
        .map(|(p, &seed)| engine.submit(request(p, sampling.clone(), seed, 40)).unwrap())
        .collect();
    gate.open();
    let outs = streams
        .iter_mut()
        .map(|s| {
            let c = collect(s, 1);
            assert_eq!((c.error.as_deref(), c.finish[0]), (None, Some(FinishReason::Length)));
            c.tokens.into_iter().next().unwrap()
        })
        .collect();
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    let stats = engine.stats();
    engine.shutdown(Duration::from_secs(1));
    (outs, stats)
}

#[test]
fn greedy_outputs_with_forced_preemption_equal_the_unpreempted_run() {
    let greedy = SamplingParams::greedy();
    let seeds = [None; 6];
    // 16 blocks of 4 hold 64 tokens; six requests growing to ~50 tokens each must preempt.
    let (tiny, tiny_stats) = run_all(16, &greedy, &seeds);
    let (big, big_stats) = run_all(1024, &greedy, &seeds);
    assert!(tiny_stats.preemptions_total > 0, "the tiny cache did not force preemption");
    assert_eq!(big_stats.preemptions_total, 0);
    for (i, p) in prompts(6).iter().enumerate() {
        let expect = reference(p, 0, &greedy, 0, 40, &[], MAX_LEN);
        assert_eq!(big[i], expect, "request {i} without preemption");
        assert_eq!(tiny[i], expect, "request {i} with preemption");
    }
}

#[test]
fn seeded_sampling_does_not_depend_on_batching_or_preemption() {
    let params = SamplingParams {
        temperature: 0.9,
        top_k: Some(40),
        top_p: 0.95,
        repetition_penalty: 1.3,
        ..Default::default()
    };
    // The last request brings no seed: the engine draws one from its own seed, in arrival order.
    let seeds = [Some(11), Some(12), Some(13), Some(14), Some(15), None];
    let (tiny, tiny_stats) = run_all(16, &params, &seeds);
    let (big, _) = run_all(1024, &params, &seeds);
    assert!(tiny_stats.preemptions_total > 0);
    assert_eq!(tiny, big);
    for (i, p) in prompts(5).iter().enumerate() {
        assert_eq!(tiny[i], reference(p, 0, &params, seeds[i].unwrap(), 40, &[], MAX_LEN), "request {i}");
    }
    let greedy: Vec<Vec<u32>> =
        prompts(5).iter().map(|p| reference(p, 0, &SamplingParams::greedy(), 0, 40, &[], MAX_LEN)).collect();
    assert_ne!(&tiny[..5], &greedy[..], "sampling should differ from greedy");
}

#[test]
fn n_completions_share_the_prompt_prefix_and_are_each_right() {
    // 10 tokens: two shared blocks and a private tail; 8 tokens: the last full block is
    // recomputed; 40 tokens: the shared prefix itself takes several prefill chunks.
    for prompt_len in [10usize, 8, 40] {
        let (engine, log) = start(4, 256);
        let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| i * 5 % 60 + 1).collect();
        let params = SamplingParams { temperature: 1.0, ..Default::default() };
        let mut req = request(prompt.clone(), params.clone(), Some(7), 12);
        req.n = 2;
        let mut stream = engine.submit(req).unwrap();
        let c = collect(&mut stream, 2);
        assert_eq!(c.error, None);
        for i in 0..2 {
            assert_eq!(c.tokens[i], reference(&prompt, i, &params, 7, 12, &[], MAX_LEN), "completion {i}");
            assert_eq!(c.finish[i], Some(FinishReason::Length));
        }
        assert_ne!(c.tokens[0], c.tokens[1], "completions draw with different seeds");
        let log = log.lock().unwrap();
        let tables: Vec<&Vec<u32>> = [1, 2].iter().map(|slot| &log.tables[&(stream.id << 16 | slot)]).collect();
        let shared = (prompt_len - 1) / 4;
        assert_eq!(&tables[0][..shared], &tables[1][..shared], "prompt blocks are shared");
        assert_ne!(tables[0][shared], tables[1][shared], "tails are private");
        drop(log);
        wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
        engine.shutdown(Duration::from_secs(1));
    }
}

#[test]
fn stop_tokens_context_limit_and_logprobs() {
    let (engine, _) = start(4, 256);
    let prompt = prompts(1).remove(0);
    let greedy = SamplingParams::greedy();
    let full = reference(&prompt, 0, &greedy, 0, 30, &[], MAX_LEN);
    // Stop at the fifth token's value: reported with finish = Stop, nothing after it.
    let mut req = request(prompt.clone(), greedy.clone(), None, 30);
    req.stop_token_ids = vec![full[4]];
    req.logprobs = Some(3);
    let c = collect(&mut engine.submit(req).unwrap(), 1);
    let upto = full.iter().position(|&t| t == full[4]).unwrap() + 1;
    assert_eq!(c.tokens[0], full[..upto]);
    assert_eq!(c.finish[0], Some(FinishReason::Stop));
    let mut history = prompt.clone();
    for (t, lp) in c.tokens[0].iter().zip(&c.logprobs[0]) {
        let expect = log_softmax(&logits_for(&history));
        let lp = lp.as_ref().expect("logprobs were asked for");
        assert!((lp.logprob - expect[*t as usize]).abs() < 1e-5);
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0].0, *t, "greedy takes the most likely token");
        history.push(*t);
    }
    // max_tokens beyond the context: not an error, ends with Length at MAX_LEN.
    let c = collect(&mut engine.submit(request(prompt.clone(), greedy.clone(), None, 1000)).unwrap(), 1);
    assert_eq!(c.tokens[0].len(), MAX_LEN - prompt.len());
    assert_eq!(c.tokens[0], reference(&prompt, 0, &greedy, 0, 1000, &[], MAX_LEN));
    assert_eq!(c.finish[0], Some(FinishReason::Length));
    assert!(c.logprobs[0].iter().all(Option::is_none), "no logprobs unless asked");
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn stats_count_tokens_finishes_and_latencies() {
    let (engine, _) = start(4, 256);
    let ps = prompts(3);
    let mut streams: Vec<_> =
        ps.iter().map(|p| engine.submit(request(p.clone(), SamplingParams::greedy(), None, 5)).unwrap()).collect();
    streams.iter_mut().for_each(|s| assert_eq!(collect(s, 1).tokens[0].len(), 5));
    wait_until("idle", || engine.stats().running == 0 && engine.stats().kv_usage == 0.0);
    let s = engine.stats();
    assert_eq!(s.generation_tokens_total, 15);
    assert_eq!(s.prompt_tokens_total, ps.iter().map(|p| p.len() as u64).sum::<u64>());
    assert_eq!((s.finished_length, s.finished_stop, s.finished_abort), (3, 0, 0));
    assert_eq!((s.time_to_first_token.count, s.e2e_latency.count, s.queue_time.count), (3, 3, 3));
    assert_eq!(s.inter_token_latency.count, 12);
    assert_eq!(s.time_to_first_token.counts.iter().sum::<u64>(), 3);
    assert_eq!(s.kv_capacity_tokens, 1024);
    engine.shutdown(Duration::from_secs(1));
}
