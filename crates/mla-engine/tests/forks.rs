//! The completions of an `n`-way request share the prompt up to its last token when the backend
//! forks blocks (`Backend::forks_blocks`): the shared prefix is computed once, each completion
//! copies the block it ends in and computes one token. `HistoryBackend` copies its token slots as
//! a real cache would, so a missing, late or misplaced fork reads unwritten or stale history and
//! changes the outputs, which are checked against `reference` in both modes.

use crate::common;

use common::*;
use mla_core::{CacheLayout, SamplingParams};
use mla_engine::{Engine, EngineHandle, FinishReason, GenerateRequest};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MAX_LEN: usize = 64;
const BS: usize = 4;

fn start(num_blocks: usize, forks: bool) -> (EngineHandle, Arc<Mutex<Log>>) {
    let mut backend = HistoryBackend::new(CacheLayout { block_size: BS, num_blocks }, MAX_LEN);
    backend.forks = forks;
    let log = backend.log.clone();
    (Engine::start(Box::new(backend), engine_config(MAX_LEN)).unwrap(), log)
}

fn sampled() -> SamplingParams {
    SamplingParams { temperature: 1.0, ..Default::default() }
}

fn n_way(prompt: &[u32], n: usize, seed: u64, max_tokens: usize) -> GenerateRequest {
    GenerateRequest { n, ..request(prompt.to_vec(), sampled(), Some(seed), max_tokens) }
}

fn check_outputs(c: &Collected, prompt: &[u32], n: usize, seed: u64, max_tokens: usize) {
    assert_eq!(c.error, None);
    for i in 0..n {
        assert_eq!(c.tokens[i], reference(prompt, i, &sampled(), seed, max_tokens, &[], MAX_LEN), "completion {i}");
        assert_eq!(c.finish[i], Some(FinishReason::Length));
    }
}

#[test]
fn each_completion_computes_one_prompt_token_when_the_backend_forks() {
    // Lengths that end inside a block, on its last slot, at the start of one, and within the
    // first block; prompts of 1 token share nothing.
    for prompt_len in [1usize, 2, 4, 5, 10, 12, 13, 40] {
        for forks in [false, true] {
            let (engine, log) = start(256, forks);
            let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| i * 7 % 60 + 1).collect();
            let n = 3;
            let mut s = engine.submit(n_way(&prompt, n, 9, 6)).unwrap();
            let c = collect(&mut s, n);
            check_outputs(&c, &prompt, n, 9, 6);
            let log = log.lock().unwrap();
            let fed = |slot: u64| log.fed.get(&(s.id << 16 | slot)).copied().unwrap_or(0);
            let whole = (prompt_len - 1) / BS * BS;
            let (prefix, each) = if forks { (prompt_len - 1, 1) } else { (whole, prompt_len - whole) };
            assert_eq!(fed(0), prefix, "prompt of {prompt_len}, forks {forks}: the shared prefix");
            for slot in 1..=n as u64 {
                // Its part of the prompt, then one token per output but the last.
                assert_eq!(fed(slot), each + 5, "prompt of {prompt_len}, forks {forks}: completion {slot}");
            }
            let ends_inside = forks && prompt_len > 1 && (prompt_len - 1) % BS != 0;
            assert_eq!(log.forks, if ends_inside { n } else { 0 }, "prompt of {prompt_len}, forks {forks}");
            drop(log);
            // The forked-from block was let go with the rest.
            wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
            engine.shutdown(Duration::from_secs(1));
        }
    }
}

#[test]
fn forks_are_right_after_a_warm_prefix_cache_and_under_preemption() {
    // The same prompt twice: the second finds its full blocks cached and computes only the
    // part of the shared prefix past them before forking.
    let prompt: Vec<u32> = (0..14u32).map(|i| i * 11 % 60 + 1).collect();
    let (engine, log) = start(256, true);
    for seed in [3, 4] {
        let mut s = engine.submit(n_way(&prompt, 3, seed, 8)).unwrap();
        let c = collect(&mut s, 3);
        check_outputs(&c, &prompt, 3, seed, 8);
        if seed == 4 {
            assert_eq!(c.cached_tokens, Some(12), "the warm request takes its full blocks from the cache");
            assert_eq!(log.lock().unwrap().fed[&(s.id << 16)], 1, "and computes one token of the shared prefix");
        }
    }
    engine.shutdown(Duration::from_secs(1));

    // 24 blocks of 4 tokens for four 3-way requests growing to 30-odd tokens each: completions
    // are preempted, some before their fork ran, and recompute their history alone.
    let gate = Arc::new(StepGate::default());
    let mut backend = HistoryBackend::new(CacheLayout { block_size: BS, num_blocks: 24 }, MAX_LEN);
    (backend.forks, backend.gate) = (true, Some(gate.clone()));
    let log = backend.log.clone();
    let engine = Engine::start(Box::new(backend), engine_config(MAX_LEN)).unwrap();
    let prompts: Vec<Vec<u32>> =
        (0..4).map(|r| (0..6 + 3 * r).map(|i| ((r * 13 + i * 5) % 60 + 1) as u32).collect()).collect();
    let mut streams: Vec<_> =
        prompts.iter().enumerate().map(|(r, p)| engine.submit(n_way(p, 3, 20 + r as u64, 24)).unwrap()).collect();
    gate.open();
    for (r, s) in streams.iter_mut().enumerate() {
        check_outputs(&collect(s, 3), &prompts[r], 3, 20 + r as u64, 24);
    }
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    assert!(engine.stats().preemptions_total > 0, "the small cache did not force preemption");
    assert!(log.lock().unwrap().forks > 0);
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn prompt_logprobs_of_an_n_way_request_are_the_same_with_forks() {
    let prompt: Vec<u32> = (0..23u32).map(|i| i * 3 % 60 + 1).collect();
    let mut got = vec![];
    for forks in [false, true] {
        let (engine, _) = start(256, forks);
        let req = GenerateRequest { prompt_logprobs: Some(3), ..n_way(&prompt, 4, 5, 4) };
        let mut s = engine.submit(req).unwrap();
        let c = collect(&mut s, 4);
        check_outputs(&c, &prompt, 4, 5, 4);
        let entries = c.prompt_logprobs.expect("asked for");
        assert_eq!(entries.len(), prompt.len() - 1);
        got.push(entries.into_iter().map(|e| (e.token, e.logprob, e.rank, e.top)).collect::<Vec<_>>());
        engine.shutdown(Duration::from_secs(1));
    }
    assert_eq!(got[0], got[1]);
}
