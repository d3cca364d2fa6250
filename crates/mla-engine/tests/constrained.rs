//! Logit bias, `min_tokens` and structured-output constraints through the engine thread, on a
//! backend that computes on the engine's thread and on one with a step thread of its own (where
//! the masks are computed while the step runs and the sampler waits for them).

use crate::common;

use common::*;
use mla_core::sampling::argmax;
use mla_core::{Backend, CacheLayout, SamplingParams};
use mla_engine::{ConstraintFactory, Engine, EngineEvent, FinishReason, TokenConstraint, MASK_BUDGET};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAX_LEN: usize = 64;
const LAYOUT: CacheLayout = CacheLayout { block_size: 4, num_blocks: 256 };

fn backends() -> Vec<(&'static str, Box<dyn Backend>)> {
    vec![
        ("inline", Box::new(HistoryBackend::new(LAYOUT, MAX_LEN))),
        ("threaded", Box::new(Threaded::new(HistoryBackend::new(LAYOUT, MAX_LEN)))),
    ]
}

/// Allows only `cycle[k % len]` as the k-th token, and records what it was told.
struct Cycle {
    cycle: Vec<u32>,
    seen: Arc<Mutex<Vec<u32>>>,
    /// Drafts followed past `seen`.
    ahead: usize,
}

impl TokenConstraint for Cycle {
    fn fill_mask(&mut self, mask: &mut [u32], _: Instant) -> Result<(), String> {
        let t = self.cycle[(self.seen.lock().unwrap().len() + self.ahead) % self.cycle.len()];
        mask[t as usize / 32] |= 1 << (t % 32);
        Ok(())
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        self.seen.lock().unwrap().push(token);
        Ok(())
    }

    fn follow(&mut self, _: u32) -> Result<(), String> {
        self.ahead += 1;
        Ok(())
    }

    fn rollback(&mut self, n: usize) {
        self.ahead -= n;
    }
}

#[test]
fn a_constraint_decides_every_token_and_sees_each_one() {
    for (name, backend) in backends() {
        let engine = Engine::start(backend, engine_config(MAX_LEN)).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let cycle = vec![5u32, 40, 63, 0];
        let (c, s) = (cycle.clone(), seen.clone());
        let mut req =
            request(prompts(1).remove(0), SamplingParams { temperature: 1.0, ..Default::default() }, Some(3), 10);
        req.constraint = Some(ConstraintFactory(Arc::new(move || {
            Box::new(Cycle { cycle: c.clone(), seen: s.clone(), ahead: 0 }) as Box<dyn TokenConstraint>
        })));
        let got = collect(&mut engine.submit(req).unwrap(), 1);
        assert_eq!(got.error, None, "{name}");
        let want: Vec<u32> = (0..10).map(|k| cycle[k % 4]).collect();
        assert_eq!(got.tokens[0], want, "{name}: only the allowed token can be drawn");
        assert_eq!(*seen.lock().unwrap(), want, "{name}: the constraint is told every token");
        let masks = engine.stats().structured_masks;
        assert_eq!((masks.masks, masks.steps), (10, 10), "{name}: one mask per draw");
        engine.shutdown(Duration::from_secs(1));
    }
}

#[test]
fn logit_bias_and_min_tokens_steer_greedy_decoding() {
    for (name, backend) in backends() {
        let engine = Engine::start(backend, engine_config(MAX_LEN)).unwrap();
        let prompt = prompts(1).remove(0);
        // What greedy decoding picks first, and a +100 bias on another token overriding it.
        let first = argmax(&logits_for(&prompt));
        let other = (first + 1) % VOCAB as u32;
        let mut req = request(prompt.clone(), SamplingParams::greedy(), None, 3);
        req.logit_bias = vec![(other, 100.0)];
        let got = collect(&mut engine.submit(req).unwrap(), 1);
        assert_eq!(got.tokens[0], vec![other; 3], "{name}");

        // The unbiased run's first token as the stop token: it ends at once without
        // min_tokens, and cannot be drawn before the fourth token with min_tokens = 4.
        let mut req = request(prompt.clone(), SamplingParams::greedy(), None, 20);
        req.stop_token_ids = vec![first];
        let got = collect(&mut engine.submit(req.clone()).unwrap(), 1);
        assert_eq!((got.tokens[0].clone(), got.finish[0]), (vec![first], Some(FinishReason::Stop)), "{name}");
        req.min_tokens = 4;
        let got = collect(&mut engine.submit(req).unwrap(), 1);
        let out = &got.tokens[0];
        assert!(out.len() >= 4, "{name}: {out:?}");
        assert!(!out[..3].contains(&first), "{name}: a stop token before min_tokens: {out:?}");
        engine.shutdown(Duration::from_secs(1));
    }
}

/// How a misbehaving constraint fails: each way fails its own request only.
#[derive(Clone, Copy, Debug)]
enum Failure {
    Panics,
    Errs,
    AllowsNothing,
}

/// Allows token 3 for `good` draws, then fails as `how` says; records each deadline's distance.
struct Failing {
    how: Failure,
    good: usize,
    budgets: Arc<Mutex<Vec<Duration>>>,
}

impl TokenConstraint for Failing {
    fn fill_mask(&mut self, mask: &mut [u32], deadline: Instant) -> Result<(), String> {
        self.budgets.lock().unwrap().push(deadline.saturating_duration_since(Instant::now()));
        if self.good > 0 {
            self.good -= 1;
            mask[0] = 1 << 3;
            return Ok(());
        }
        match self.how {
            Failure::Panics => panic!("grammar engine bug"),
            Failure::Errs => Err("the grammar gave up".into()),
            Failure::AllowsNothing => Ok(()),
        }
    }
    fn accept(&mut self, _: u32) -> Result<(), String> {
        Ok(())
    }
    // What it allows counts masks, not tokens.
    fn follow(&mut self, _: u32) -> Result<(), String> {
        Ok(())
    }
    fn rollback(&mut self, _: usize) {}
}

#[test]
fn a_failing_constraint_fails_its_request_and_no_other() {
    for (name, backend) in backends() {
        let engine = Engine::start(backend, engine_config(MAX_LEN)).unwrap();
        for (how, want) in [
            (Failure::Panics, "panicked computing its token mask"),
            (Failure::Errs, "the grammar gave up"),
            (Failure::AllowsNothing, "allows no token"),
        ] {
            let budgets = Arc::new(Mutex::new(vec![]));
            let b = budgets.clone();
            let mut bad = request(prompts(2).remove(0), SamplingParams::greedy(), None, 5);
            bad.constraint = Some(ConstraintFactory(Arc::new(move || {
                Box::new(Failing { how, good: 2, budgets: b.clone() }) as Box<dyn TokenConstraint>
            })));
            let good = request(prompts(2).remove(1), SamplingParams::greedy(), None, 5);
            let (mut b, mut g) = (engine.submit(bad).unwrap(), engine.submit(good).unwrap());
            let (b, g) = (collect(&mut b, 1), collect(&mut g, 1));
            assert_eq!(b.error, None, "{name} {how:?}: the request's own doing, not an engine error");
            let why = b.rejected.unwrap_or_default();
            assert!(why.starts_with("structured output: ") && why.contains(want), "{name} {how:?}: {why}");
            // The two good draws arrived; the failed draw's token did not.
            assert_eq!(b.tokens[0], vec![3, 3], "{name} {how:?}");
            assert_eq!((g.error, g.tokens[0].len()), (None, 5), "{name} {how:?}");
            // Every mask was given the budget, counted from when it started.
            let budgets = budgets.lock().unwrap();
            assert_eq!(budgets.len(), 3, "{name} {how:?}");
            assert!(budgets.iter().all(|&d| d <= MASK_BUDGET && d > MASK_BUDGET / 2), "{name} {how:?}: {budgets:?}");
        }
        // The failures cost no step: the engine still serves.
        let got =
            collect(&mut engine.submit(request(prompts(1).remove(0), SamplingParams::greedy(), None, 3)).unwrap(), 1);
        assert_eq!((got.error, got.tokens[0].len()), (None, 3), "{name}");
        engine.shutdown(Duration::from_secs(1));
    }
}

#[test]
fn a_constraint_failing_in_one_completion_ends_the_whole_request_once() {
    for (name, backend) in backends() {
        let engine = Engine::start(backend, engine_config(MAX_LEN)).unwrap();
        let budgets = Arc::new(Mutex::new(vec![]));
        let mut bad = request(prompts(1).remove(0), SamplingParams::greedy(), None, 5);
        bad.n = 3;
        bad.constraint = Some(ConstraintFactory(Arc::new(move || {
            Box::new(Failing { how: Failure::Errs, good: 1, budgets: budgets.clone() }) as Box<dyn TokenConstraint>
        })));
        let mut stream = engine.submit(bad).unwrap();
        let mut errors = 0;
        while let Some(event) = next_event(&mut stream.events) {
            if matches!(event, EngineEvent::Rejected { .. } | EngineEvent::Error { .. }) {
                errors += 1;
            }
        }
        assert_eq!(errors, 1, "{name}: one rejection for the request, not one per completion");
        engine.shutdown(Duration::from_secs(1));
    }
}

/// Allows every token, but fails to follow the `fail_at`th one drawn (as a grammar engine past
/// one of its limits does).
struct BreaksAt {
    fail_at: usize,
    drawn: usize,
}

impl TokenConstraint for BreaksAt {
    fn fill_mask(&mut self, mask: &mut [u32], _: Instant) -> Result<(), String> {
        mask.iter_mut().for_each(|w| *w = u32::MAX);
        Ok(())
    }
    fn accept(&mut self, _: u32) -> Result<(), String> {
        self.drawn += 1;
        match self.drawn == self.fail_at {
            true => Err("too many expressions".into()),
            false => Ok(()),
        }
    }
    fn follow(&mut self, token: u32) -> Result<(), String> {
        self.accept(token)
    }
    fn rollback(&mut self, n: usize) {
        self.drawn -= n;
    }
}

#[test]
fn a_constraint_that_cannot_follow_a_token_rejects_its_request() {
    for (name, backend) in backends() {
        let engine = Engine::start(backend, engine_config(MAX_LEN)).unwrap();
        let mut bad = request(prompts(2).remove(0), SamplingParams::greedy(), None, 6);
        bad.constraint = Some(ConstraintFactory(Arc::new(|| {
            Box::new(BreaksAt { fail_at: 3, drawn: 0 }) as Box<dyn TokenConstraint>
        })));
        let good = request(prompts(2).remove(1), SamplingParams::greedy(), None, 6);
        let (mut b, mut g) = (engine.submit(bad).unwrap(), engine.submit(good).unwrap());
        let (b, g) = (collect(&mut b, 1), collect(&mut g, 1));
        assert_eq!(b.rejected.as_deref(), Some("structured output: too many expressions"), "{name}");
        assert_eq!(b.tokens[0].len(), 2, "{name}: the token it could not follow is not delivered");
        assert_eq!((g.error, g.rejected, g.tokens[0].len()), (None, None, 6), "{name}");
        engine.shutdown(Duration::from_secs(1));
    }
}
