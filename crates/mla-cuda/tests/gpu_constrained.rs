//! Logit bias, `min_tokens` and structured-output constraints through the engine on the CUDA
//! backend: the engine fills each step's masks on its own thread after `start_step`, while the
//! device runs the forward pass (eagerly for prefill, from a CUDA graph for decode), and the
//! device sampler waits for them. Model: the `real_dims` fixture (512 tokens).
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_constrained -- --ignored --test-threads 1`.

mod common;

use common::*;
use mla_core::SamplingParams;
use mla_cuda::{CudaBackend, CudaOptions, WeightsFrom};
use mla_engine::{
    ConstraintFactory, Engine, EngineConfig, EngineEvent, EngineHandle, FinishReason, GenerateRequest, TokenConstraint,
};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn engine() -> (EngineHandle, Arc<Mutex<mla_cuda::StepClock>>) {
    let dir = real_dims_dir();
    let cfg = mla_core::ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let opts = CudaOptions {
        max_num_batched_tokens: 256,
        max_num_seqs: 8,
        num_blocks: Some(64),
        cuda_graph_batch_sizes: vec![1, 2, 4],
        ..Default::default()
    };
    let backend = CudaBackend::new(cfg, WeightsFrom::Checkpoint(dir), opts).unwrap();
    let clock = backend.step_clock();
    let ecfg = EngineConfig {
        spec_load_rule: false,
        long_prefill_token_threshold: None,
        max_model_len: 128,
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
        max_queued_requests: 16,
        seed: 7,
        prefix_caching: true,
        mixed_steps: false,
        mtp_drafts: 0,
        spec_disable_batch: None,
        step_watchdog: Duration::from_secs(300),
        router: mla_engine::RouterConfig::default(),
    };
    (Engine::start(Box::new(backend), ecfg).unwrap(), clock)
}

fn request(prompt: Vec<u32>, sampling: SamplingParams, seed: Option<u64>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest { seed, ..GenerateRequest::new(prompt, sampling, max_tokens) }
}

/// The tokens of a one-completion request and how it finished; panics on an engine error.
fn run(engine: &EngineHandle, req: GenerateRequest) -> (Vec<u32>, Option<FinishReason>) {
    let mut stream = engine.submit(req).unwrap();
    let (mut tokens, mut finish) = (Vec::new(), None);
    while let Some(ev) = stream.events.blocking_recv() {
        match ev {
            EngineEvent::Admitted { .. } | EngineEvent::PromptLogprobs { .. } => {}
            EngineEvent::Token { token, finish: f, .. } => {
                tokens.push(token);
                finish = f;
            }
            EngineEvent::Finished { reason, .. } => finish = Some(reason),
            EngineEvent::Error { message } | EngineEvent::Rejected { message } => panic!("engine error: {message}"),
        }
    }
    (tokens, finish)
}

/// Allows only `cycle[k % len]` as the k-th token.
struct Cycle {
    cycle: Vec<u32>,
    drawn: usize,
}

impl TokenConstraint for Cycle {
    fn fill_mask(&mut self, mask: &mut [u32], _: std::time::Instant) -> Result<(), String> {
        let t = self.cycle[self.drawn % self.cycle.len()];
        mask[t as usize / 32] |= 1 << (t % 32);
        Ok(())
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        let want = self.cycle[self.drawn % self.cycle.len()];
        self.drawn += 1;
        if token == want {
            Ok(())
        } else {
            Err(format!("drew {token}, only {want} was allowed"))
        }
    }

    fn follow(&mut self, token: u32) -> Result<(), String> {
        self.accept(token)
    }

    fn rollback(&mut self, n: usize) {
        self.drawn -= n;
    }
}

fn prompt(i: usize) -> Vec<u32> {
    (0..9 + 5 * i).map(|k| ((i * 31 + k * 17) % 500 + 3) as u32).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn constraints_decide_every_token_on_eager_and_graph_steps() {
    let (engine, clock) = engine();
    let cycles = [vec![5u32, 40, 511, 0], vec![300u32, 301], vec![17u32, 256, 480]];
    let params = [
        SamplingParams::greedy(),
        SamplingParams { temperature: 1.0, ..Default::default() },
        SamplingParams { temperature: 0.7, top_p: 0.8, top_k: Some(20), ..Default::default() },
    ];
    // Three concurrent requests: the prefill draws eagerly, the decode steps replay graphs.
    let handles: Vec<_> = (0..3)
        .map(|i| {
            let mut req = request(prompt(i), params[i].clone(), Some(11 + i as u64), 12);
            let c = cycles[i].clone();
            req.constraint = Some(ConstraintFactory(Arc::new(move || {
                Box::new(Cycle { cycle: c.clone(), drawn: 0 }) as Box<dyn TokenConstraint>
            })));
            engine.submit(req).unwrap()
        })
        .collect();
    for (i, mut stream) in handles.into_iter().enumerate() {
        let mut tokens = Vec::new();
        while let Some(ev) = stream.events.blocking_recv() {
            match ev {
                EngineEvent::Token { token, .. } => tokens.push(token),
                EngineEvent::Error { message } | EngineEvent::Rejected { message } => panic!("request {i}: {message}"),
                _ => {}
            }
        }
        let want: Vec<u32> = (0..12).map(|k| cycles[i][k % cycles[i].len()]).collect();
        assert_eq!(tokens, want, "request {i}: only the allowed token can be drawn");
    }
    let graph_steps = clock.lock().unwrap().graph_steps;
    assert!(graph_steps > 0, "the masked decode steps should have replayed graphs");
    engine.shutdown(Duration::from_secs(5));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn logit_bias_and_min_tokens_steer_greedy_decoding() {
    let (engine, _) = engine();
    let p = prompt(1);
    let (plain, _) = run(&engine, request(p.clone(), SamplingParams::greedy(), None, 4));
    // +100 on another token makes it every greedy draw.
    let other = (plain[0] + 1) % 512;
    let mut req = request(p.clone(), SamplingParams::greedy(), None, 4);
    req.logit_bias = vec![(other, 100.0)];
    assert_eq!(run(&engine, req).0, vec![other; 4]);
    // That token as the stop token: without min_tokens the completion ends at once; with
    // min_tokens 4 it is -inf (on top of its +100) for the first four draws, then ends it.
    let mut req = request(p.clone(), SamplingParams::greedy(), None, 20);
    req.logit_bias = vec![(other, 100.0)];
    req.stop_token_ids = vec![other];
    assert_eq!(run(&engine, req.clone()), (vec![other], Some(FinishReason::Stop)));
    req.min_tokens = 4;
    let (out, finish) = run(&engine, req);
    assert_eq!(out.len(), 5, "{out:?}");
    assert!(!out[..4].contains(&other), "a stop token before min_tokens: {out:?}");
    assert_eq!((out[4], finish), (other, Some(FinishReason::Stop)), "{out:?}");
    engine.shutdown(Duration::from_secs(5));
}
