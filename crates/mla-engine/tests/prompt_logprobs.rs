//! Prompt logprobs through the engine thread: every prompt token scored from the logits of the
//! position before it, whatever chunking, sharing (`n > 1`) and prefix caching do.

use crate::common;

use common::*;
use mla_core::sampling::{log_softmax, top_k_entries};
use mla_core::{CacheLayout, SamplingParams};
use mla_engine::{Engine, FinishReason, GenerateRequest};
use std::time::Duration;

const MAX_LEN: usize = 64;

/// The scores computed without any cache: position `p`'s logits are the model's over `..=p`.
/// (token, logprob, rank, top) per scored prompt token.
type Scores = Vec<(u32, f32, u32, Vec<(u32, f32)>)>;

fn expected(prompt: &[u32], k: usize) -> Scores {
    (1..prompt.len())
        .map(|i| {
            let lp = log_softmax(&logits_for(&prompt[..i]));
            let t = prompt[i];
            let rank = 1 + lp.iter().filter(|&&x| x > lp[t as usize]).count() as u32;
            (t, lp[t as usize], rank, top_k_entries(&lp, k))
        })
        .collect()
}

fn with_prompt_logprobs(prompt: Vec<u32>, n: usize, k: usize) -> GenerateRequest {
    GenerateRequest { n, prompt_logprobs: Some(k), ..request(prompt, SamplingParams::greedy(), None, 3) }
}

#[test]
fn prompt_logprobs_are_exact_across_chunks_sharing_and_a_warm_prefix_cache() {
    // A 16-token step budget and 4-token blocks: the 40-token prompt is prefilled in chunks,
    // with n = 3 through a shared prefix.
    let backend = HistoryBackend::new(CacheLayout { block_size: 4, num_blocks: 128 }, MAX_LEN);
    let engine = Engine::start(Box::new(backend), engine_config(MAX_LEN)).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 60 + 1) as u32).collect();

    // Warm the prefix cache with the same prompt first.
    let mut warm = engine.submit(request(prompt.clone(), SamplingParams::greedy(), None, 2)).unwrap();
    let c = collect(&mut warm, 1);
    assert!(c.prompt_logprobs.is_none(), "not asked for");
    let mut again = engine.submit(request(prompt.clone(), SamplingParams::greedy(), None, 2)).unwrap();
    assert!(collect(&mut again, 1).cached_tokens.unwrap() > 0, "the cache is warm");

    for n in [1, 3] {
        let mut s = engine.submit(with_prompt_logprobs(prompt.clone(), n, 2)).unwrap();
        let c = collect(&mut s, n);
        assert_eq!(c.error, None);
        assert_eq!(c.cached_tokens, Some(0), "cached blocks have no logits: the prompt is computed");
        assert!(c.finish.iter().all(|f| *f == Some(FinishReason::Length)));
        let got: Vec<_> = c.prompt_logprobs.unwrap().into_iter().map(|e| (e.token, e.logprob, e.rank, e.top)).collect();
        assert_eq!(got, expected(&prompt, 2), "n = {n}");
        // The outputs are the ones a request without prompt logprobs gets.
        let want = reference(&prompt, 0, &SamplingParams::greedy(), 0, 3, &[], MAX_LEN);
        assert!(c.tokens.iter().all(|t| *t == want));
    }

    // One-token prompts have nothing to score, but still say so.
    let mut s = engine.submit(with_prompt_logprobs(vec![5], 1, 1)).unwrap();
    assert_eq!(collect(&mut s, 1).prompt_logprobs, Some(vec![]));
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    engine.shutdown(Duration::from_secs(1));
}

#[test]
fn prompt_logprobs_survive_preemption() {
    // 16 blocks of 4 tokens: a long-running request and a scored one do not fit together, so
    // the newer is preempted (during its prefill or after) and recomputed.
    // The engine is held at its first step until both are queued: on a busy machine it could
    // otherwise finish the long request before the scored one arrives, and nothing is preempted.
    let gate = std::sync::Arc::new(StepGate::default());
    let mut backend = HistoryBackend::new(CacheLayout { block_size: 4, num_blocks: 16 }, MAX_LEN);
    backend.gate = Some(gate.clone());
    let engine = Engine::start(Box::new(backend), engine_config(MAX_LEN)).unwrap();
    let long: Vec<u32> = (0..10).map(|i| (i * 5 % 60 + 2) as u32).collect();
    let scored: Vec<u32> = (0..30).map(|i| (i * 11 % 60 + 1) as u32).collect();
    let mut a = engine.submit(request(long, SamplingParams::greedy(), None, 40)).unwrap();
    let mut b =
        engine.submit(GenerateRequest { max_tokens: 20, ..with_prompt_logprobs(scored.clone(), 1, 3) }).unwrap();
    gate.open();
    let (ca, cb) = (collect(&mut a, 1), collect(&mut b, 1));
    assert_eq!((ca.error, cb.error), (None, None));
    let got: Vec<_> = cb.prompt_logprobs.unwrap().into_iter().map(|e| (e.token, e.logprob, e.rank, e.top)).collect();
    assert_eq!(got, expected(&scored, 3));
    assert!(engine.stats().preemptions_total > 0, "the cache was meant to force preemption");
    engine.shutdown(Duration::from_secs(1));
}
