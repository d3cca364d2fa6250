//! Speculative decoding through the engine (`EngineConfig::mtp_drafts`) on the CPU reference
//! with the MTP fixture (tests/fixtures/v3_mtp): every request's output equals the output of the
//! same engine without speculation, token for token, under concurrency, chunked prefill, mixed
//! steps, prefix caching, `n > 1`, `min_tokens`, stop tokens, `max_tokens` cut inside a step's
//! emitted tokens, preemption by recompute, penalties, logit_bias and structured output.
//!
//! The fixture's MTP layer is untrained, so its own drafts rarely stand. To exercise the engine
//! with drafts that do, `ForcedDrafts` wraps the backend and replaces each step's drafts with
//! the sequence's true continuation (from a run without speculation), one of them planted wrong
//! on some steps. Verification is the target's, so what is emitted stays exact; the engine must
//! take 1 to K+1 tokens per row, account the cache and blocks for them, and stop in the middle.

use crate::common;

use common::{collect, engine_config, wait_until};
use mla_core::step::plan::{StepOutput, StepPlan};
use mla_core::{Backend, CacheLayout, Checkpoint, ModelConfig, PendingStep, SamplingParams, StepLimits};
use mla_cpu::CpuBackend;
use mla_engine::{ConstraintFactory, Engine, EngineStats, GenerateRequest, TokenConstraint};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAX_LEN: usize = 128;
const BLOCK_SIZE: usize = 16;

fn fixture() -> (ModelConfig, Checkpoint) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/v3_mtp");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir, &cfg).unwrap();
    (cfg, ckpt)
}

fn cpu_backend(num_blocks: usize, mtp: bool) -> CpuBackend {
    let (cfg, ckpt) = fixture();
    let b = CpuBackend::new(cfg, &ckpt, BLOCK_SIZE, num_blocks).unwrap();
    if mtp {
        b.with_mtp(&ckpt).unwrap()
    } else {
        b
    }
}

/// Replaces the drafts of every result with the sequence's true continuation (the whole token
/// sequence of a run without speculation, found by the tokens the sequence has fed), planting a
/// wrong one on every third step at a place that moves.
struct ForcedDrafts {
    inner: CpuBackend,
    pending: PendingStep,
    references: Vec<Vec<u32>>,
    /// Per sequence id, the tokens it has fed so far (reset when it is prefilled from 0 again).
    fed: HashMap<u64, Vec<u32>>,
    steps: usize,
    vocab: u32,
}

impl ForcedDrafts {
    /// `inner` with its drafts replaced from `references` (whole token sequences, prompt and
    /// output, of a run without speculation).
    fn over(inner: CpuBackend, references: Vec<Vec<u32>>) -> Self {
        let vocab = inner.model_config().vocab_size as u32;
        ForcedDrafts { inner, pending: PendingStep::default(), references, fed: HashMap::new(), steps: 0, vocab }
    }

    fn true_drafts(&mut self, plan: &StepPlan, out: &mut StepOutput) {
        self.steps += 1;
        for (s, r) in plan.seqs.iter().zip(&mut out.seqs) {
            let fed_real = s.tokens.len() - s.drafts_fed();
            let history = self.fed.entry(s.seq_id).or_default();
            history.truncate(s.context_len);
            if history.len() < s.context_len {
                // Positions this sequence never fed here: a shared prefix of `n > 1` or blocks
                // from the prefix cache. Take them from the reference that has the fed tokens
                // at these positions.
                let at = s.context_len..s.context_len + fed_real;
                let Some(reference) = self.references.iter().find(|t| t.get(at.clone()) == Some(&s.tokens[..fed_real]))
                else {
                    panic!("sequence {}: no reference feeds {:?} at {at:?}", s.seq_id, &s.tokens[..fed_real])
                };
                *history = reference[..s.context_len].to_vec();
            }
            history.extend_from_slice(&s.tokens[..fed_real]);
            history.extend(r.sampled.iter().chain(&r.extra_tokens).map(|t| t.token));
            let in_cache = s.context_len + fed_real + r.extra_tokens.len();
            if r.drafts.is_empty() {
                // Keep only what is in the cache: the last emitted token is fed next step.
                history.truncate(in_cache);
                continue;
            }
            // A sequence may emit past its reference's end (max_tokens cuts it in the engine).
            let agrees = |t: &&Vec<u32>| {
                let n = t.len().min(history.len());
                t[..n] == history[..n]
            };
            let Some(reference) = self.references.iter().find(agrees) else {
                panic!("sequence {} left every reference: {history:?}", s.seq_id)
            };
            let k = r.drafts.len();
            let at = history.len();
            let mut drafts: Vec<u32> = (0..k).map(|j| reference.get(at + j).copied().unwrap_or(0)).collect();
            if self.steps.is_multiple_of(3) {
                let j = (self.steps / 3) % k;
                drafts[j] = (drafts[j] + 1) % self.vocab;
            }
            r.drafts = drafts;
            history.truncate(in_cache);
        }
    }
}

impl Backend for ForcedDrafts {
    fn device_name(&self) -> String {
        "cpu with forced drafts".into()
    }
    fn verifies_shaped_drafts(&self) -> bool {
        self.inner.verifies_shaped_drafts()
    }
    fn model_config(&self) -> &ModelConfig {
        self.inner.model_config()
    }
    fn cache_layouts(&self) -> Vec<CacheLayout> {
        self.inner.cache_layouts()
    }
    fn step_limits(&self) -> StepLimits {
        self.inner.step_limits()
    }
    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        self.pending.set(plans);
    }
    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        let plans = self.pending.take()?;
        self.inner.start_step(&plans);
        let mut outs = self.inner.finish_step()?;
        for (plan, out) in plans.iter().zip(&mut outs) {
            self.true_drafts(plan, out);
        }
        Ok(outs)
    }
}

/// Requests that cover what the engine must keep exact: greedy ones of several lengths (some
/// with a stop token, one with `min_tokens`, one with `n = 2`), a shared prompt (prefix cache),
/// a sampled one with a seed (it drafts: rejection sampling keeps its distribution, not its
/// draws, so it is `SAMPLED` and compared by length and reproducibility) and one that never
/// drafts (a repetition penalty).
fn requests() -> Vec<GenerateRequest> {
    let greedy = SamplingParams::greedy();
    let prompt = |len: usize, salt: u32| -> Vec<u32> {
        std::iter::once(0).chain((1..len as u32).map(|i| (i * 37 + salt * 11) % 500 + 2)).collect()
    };
    vec![
        GenerateRequest::new(prompt(5, 1), greedy.clone(), 30),
        GenerateRequest::new(prompt(20, 2), greedy.clone(), 25),
        GenerateRequest::new(prompt(40, 3), greedy.clone(), 17),
        GenerateRequest::new(prompt(40, 3), greedy.clone(), 20),
        GenerateRequest {
            min_tokens: 8,
            stop_token_ids: vec![201, 258],
            ..GenerateRequest::new(prompt(9, 4), greedy.clone(), 30)
        },
        GenerateRequest { stop_token_ids: vec![201], ..GenerateRequest::new(prompt(12, 5), greedy.clone(), 40) },
        GenerateRequest { n: 2, ..GenerateRequest::new(prompt(33, 6), greedy.clone(), 22) },
        GenerateRequest {
            seed: Some(7),
            ..GenerateRequest::new(prompt(7, 7), SamplingParams { temperature: 0.8, ..Default::default() }, 20)
        },
        GenerateRequest::new(prompt(8, 8), SamplingParams { repetition_penalty: 1.3, ..SamplingParams::greedy() }, 20),
    ]
}

/// Every request at once; their outputs in order, and the engine's statistics.
fn run(backend: Box<dyn Backend>, mtp_drafts: usize, mixed: bool, budget: usize) -> (Vec<Vec<Vec<u32>>>, EngineStats) {
    run_paused(backend, mtp_drafts, mixed, budget, None)
}

/// `run` with drafting paused while `disable` or more sequences run.
fn run_paused(
    backend: Box<dyn Backend>,
    mtp_drafts: usize,
    mixed: bool,
    budget: usize,
    disable: Option<usize>,
) -> (Vec<Vec<Vec<u32>>>, EngineStats) {
    run_these(requests(), backend, mtp_drafts, mixed, budget, disable)
}

/// `run_paused` with requests `reqs`.
fn run_these(
    reqs: Vec<GenerateRequest>,
    backend: Box<dyn Backend>,
    mtp_drafts: usize,
    mixed: bool,
    budget: usize,
    disable: Option<usize>,
) -> (Vec<Vec<Vec<u32>>>, EngineStats) {
    let cfg = mla_engine::EngineConfig {
        mtp_drafts,
        spec_disable_batch: disable,
        mixed_steps: mixed,
        max_num_batched_tokens: budget,
        ..engine_config(MAX_LEN)
    };
    let engine = Engine::start(backend, cfg).unwrap();
    let mut streams: Vec<_> = reqs.iter().map(|r| (r.n, engine.submit(r.clone()).unwrap())).collect();
    let outs = streams
        .iter_mut()
        .map(|(n, s)| {
            let c = collect(s, *n);
            assert_eq!(c.error, None);
            c.tokens
        })
        .collect();
    // A stream ends with its last token, before the engine publishes that step's statistics:
    // read them once every block is back, which that step's publication shows.
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    let stats = engine.stats();
    engine.shutdown(Duration::from_secs(1));
    (outs, stats)
}

/// The index in `requests()` of the sampled request that drafts.
const SAMPLED: usize = 7;

/// `outs` without the sampled request's tokens (its length kept).
fn exact_part(outs: &[Vec<Vec<u32>>]) -> Vec<Vec<Vec<u32>>> {
    let mut o = outs.to_vec();
    o[SAMPLED] = o[SAMPLED].iter().map(|t| vec![0; t.len()]).collect();
    o
}

fn references(outs: &[Vec<Vec<u32>>]) -> Vec<Vec<u32>> {
    references_of(&requests(), outs)
}

/// Each completion's whole token sequence (prompt and output) of requests `reqs`.
fn references_of(reqs: &[GenerateRequest], outs: &[Vec<Vec<u32>>]) -> Vec<Vec<u32>> {
    reqs.iter()
        .zip(outs)
        .flat_map(|(r, o)| o.iter().map(move |t| r.prompt_tokens.iter().chain(t).copied().collect()))
        .collect()
}

#[test]
fn outputs_with_the_mtp_layers_own_drafts_equal_the_plain_engine() {
    for (mixed, budget) in [(false, 16), (true, 24)] {
        let (plain, _) = run(Box::new(cpu_backend(64, false)), 0, mixed, budget);
        for k in [1, 3] {
            let (spec, stats) = run(Box::new(cpu_backend(64, true)), k, mixed, budget);
            assert_eq!(exact_part(&spec), exact_part(&plain), "K = {k}, mixed {mixed}");
            assert!(stats.spec.draft_tokens > 0, "K = {k}: nothing was drafted");
            if mixed {
                // The sampled request reproduces its tokens under the same configuration.
                let (again, _) = run(Box::new(cpu_backend(64, true)), k, mixed, budget);
                assert_eq!(again[SAMPLED], spec[SAMPLED], "K = {k}: the seeded sampled request");
            }
        }
    }
}

#[test]
fn drafting_pauses_while_the_batch_reaches_disable_by_batch_size() {
    let (plain, _) = run(Box::new(cpu_backend(64, false)), 0, true, 24);
    // Some sequence always runs: a pause at 1 never drafts, and the outputs are the plain ones.
    let (never, stats) = run_paused(Box::new(cpu_backend(64, true)), 2, true, 24, Some(1));
    assert_eq!(never, plain);
    assert_eq!((stats.spec.drafts, stats.spec.draft_tokens), (0, 0));
    // A pause at 3 of the 6 sequences: drafting only in the tail, once fewer than 3 run.
    let (_, free) = run_paused(Box::new(cpu_backend(64, true)), 2, true, 24, None);
    let (tail, some) = run_paused(Box::new(cpu_backend(64, true)), 2, true, 24, Some(3));
    assert_eq!(exact_part(&tail), exact_part(&plain));
    assert!(
        some.spec.drafts > 0 && some.spec.drafts < free.spec.drafts,
        "{} verify rows paused at 3, {} without",
        some.spec.drafts,
        free.spec.drafts
    );
}

#[test]
fn drafts_that_stand_give_the_same_outputs_with_fewer_steps() {
    let (plain, plain_stats) = run(Box::new(cpu_backend(64, false)), 0, true, 24);
    let refs = references(&plain);
    for k in [1, 2, 4] {
        let forced = ForcedDrafts::over(cpu_backend(64, true), refs.clone());
        let (spec, stats) = run(Box::new(forced), k, true, 24);
        assert_eq!(spec, plain, "K = {k}");
        let s = &stats.spec;
        eprintln!(
            "K = {k}: {} of {} drafts stood over {} verify rows; {} steps against {} without",
            s.accepted_tokens, s.draft_tokens, s.drafts, stats.steps.steps, plain_stats.steps.steps
        );
        assert!(s.accepted_tokens * 2 > s.draft_tokens, "K = {k}: forced drafts mostly stand");
        assert!(s.accepted_tokens < s.draft_tokens, "K = {k}: the planted errors are rejected");
        assert_eq!(s.accepted_per_pos.len(), k);
        assert!(stats.steps.steps < plain_stats.steps.steps, "K = {k}: standing drafts save steps");
    }
}

#[test]
fn preemption_with_drafts_in_flight_keeps_outputs_exact() {
    // 12 blocks of 16 tokens cannot hold every request at once: sequences are preempted and
    // recomputed, their drafts dropped and drafted again.
    let (plain, _) = run(Box::new(cpu_backend(64, false)), 0, true, 24);
    let refs = references(&plain);
    let forced = ForcedDrafts::over(cpu_backend(12, true), refs);
    let (spec, stats) = run(Box::new(forced), 3, true, 24);
    assert!(stats.preemptions_total > 0, "the small cache was meant to preempt");
    assert_eq!(spec, plain);
}

/// The CPU backend saying it lacks what the CUDA backend lacks today: block forks
/// (`Backend::forks_blocks`) unless `forks`, verified shaped drafts
/// (`Backend::verifies_shaped_drafts`) unless `shaped`.
struct Narrowed {
    inner: CpuBackend,
    forks: bool,
    shaped: bool,
}

impl Backend for Narrowed {
    fn device_name(&self) -> String {
        format!("cpu (forks {}, shaped drafts {})", self.forks, self.shaped)
    }
    fn model_config(&self) -> &ModelConfig {
        self.inner.model_config()
    }
    fn cache_layouts(&self) -> Vec<CacheLayout> {
        self.inner.cache_layouts()
    }
    fn step_limits(&self) -> StepLimits {
        self.inner.step_limits()
    }
    fn verifies_sampled_drafts(&self) -> bool {
        self.inner.verifies_sampled_drafts()
    }
    fn verifies_shaped_drafts(&self) -> bool {
        self.shaped
    }
    fn forks_blocks(&self) -> bool {
        self.forks
    }
    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        self.inner.start_step(plans)
    }
    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        self.inner.finish_step()
    }
}

#[test]
fn n_way_requests_give_the_same_outputs_and_drafts_with_and_without_forks() {
    // Greedy 3-way requests whose prompts end inside a block, on a block's last slot and at a
    // block's start (blocks of 16), drafting 2 tokens a step. With forks each completion
    // computes its last prompt token over a copy of the block the shared prefix ended in;
    // without, it recomputes that block. Outputs and the drafting counters agree. (Sampled
    // requests are left out: their outputs depend on the drafts' exact distributions, which the
    // order rows are batched in moves in the last bits, so two runs of one engine can differ.
    // The copy of the MTP layer's rows is checked step by step in mla-cpu's
    // `a_forked_block_carries_every_layers_rows_the_mtp_layers_too`.)
    let greedy = SamplingParams::greedy();
    let reqs: Vec<GenerateRequest> = [5usize, 16, 17, 30, 40]
        .iter()
        .enumerate()
        .map(|(i, &len)| GenerateRequest {
            n: 3,
            seed: Some(100 + i as u64),
            ..GenerateRequest::new(
                (0..len as u32).map(|t| (t * 29 + 7 * i as u32) % 500 + 2).collect(),
                greedy.clone(),
                12,
            )
        })
        .collect();
    let run = |backend: Box<dyn Backend>| {
        // Room for every completion and all its drafts in every step.
        let cfg = mla_engine::EngineConfig {
            mtp_drafts: 2,
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
            ..engine_config(MAX_LEN)
        };
        let engine = Engine::start(backend, cfg).unwrap();
        let mut streams: Vec<_> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
        let outs: Vec<Vec<Vec<u32>>> = streams
            .iter_mut()
            .map(|s| {
                let c = collect(s, 3);
                assert_eq!(c.error, None);
                c.tokens
            })
            .collect();
        wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
        let spec = engine.stats().spec;
        engine.shutdown(Duration::from_secs(1));
        (outs, spec)
    };
    let forked = cpu_backend(256, true);
    assert!(forked.forks_blocks());
    let (with_forks, spec_forks) = run(Box::new(forked));
    let (without, spec_without) = run(Box::new(Narrowed { inner: cpu_backend(256, true), forks: false, shaped: true }));
    assert_eq!(with_forks, without);
    assert!(spec_forks.draft_tokens > 0, "the requests drafted");
    assert_eq!(spec_forks, spec_without);
}

/// Greedy requests whose rows are shaped: repetition, presence and frequency penalties (counting
/// the drafts before each verify row as output) and a logit_bias, with and without min_tokens.
fn shaped_requests() -> Vec<GenerateRequest> {
    let greedy = SamplingParams::greedy();
    let prompt = |len: usize, salt: u32| -> Vec<u32> {
        std::iter::once(0).chain((1..len as u32).map(|i| (i * 41 + salt * 13) % 500 + 2)).collect()
    };
    let penalised =
        |r, p, f| SamplingParams { repetition_penalty: r, presence_penalty: p, frequency_penalty: f, ..greedy.clone() };
    vec![
        GenerateRequest::new(prompt(9, 1), penalised(1.3, 0.0, 0.0), 30),
        GenerateRequest::new(prompt(14, 2), penalised(1.0, 0.8, 0.5), 30),
        GenerateRequest::new(prompt(21, 3), penalised(1.1, 0.4, 0.9), 26),
        GenerateRequest {
            logit_bias: vec![(17, 3.0), (201, -100.0), (344, 1.5)],
            ..GenerateRequest::new(prompt(11, 4), greedy.clone(), 30)
        },
        GenerateRequest {
            min_tokens: 6,
            stop_token_ids: vec![201],
            logit_bias: vec![(17, 2.0)],
            ..GenerateRequest::new(prompt(7, 5), penalised(1.2, 0.3, 0.0), 24)
        },
    ]
}

#[test]
fn penalised_and_biased_requests_draft_and_stay_exact() {
    let reqs = shaped_requests();
    let (plain, plain_stats) = run_these(reqs.clone(), Box::new(cpu_backend(64, false)), 0, true, 24, None);
    // The MTP layer's own drafts, then drafts forced from the true continuation (one planted
    // wrong every third step), so rows verify with accepted drafts in their penalty history.
    let (own, own_stats) = run_these(reqs.clone(), Box::new(cpu_backend(64, true)), 2, true, 24, None);
    assert_eq!(own, plain);
    assert!(own_stats.spec.drafts > 0, "the shaped requests draft");
    for k in [1, 3] {
        let forced = ForcedDrafts::over(cpu_backend(64, true), references_of(&reqs, &plain));
        let (spec, stats) = run_these(reqs.clone(), Box::new(forced), k, true, 24, None);
        assert_eq!(spec, plain, "K = {k}");
        let s = &stats.spec;
        assert!(s.accepted_tokens * 2 > s.draft_tokens, "K = {k}: forced drafts mostly stand ({s:?})");
        assert!(s.accepted_tokens < s.draft_tokens, "K = {k}: the planted errors are rejected");
        assert!(stats.steps.steps < plain_stats.steps.steps, "K = {k}: standing drafts save steps");
    }
    // A backend that does not verify shaped rows: the same requests never draft.
    let (unshaped, none) = run_these(
        reqs,
        Box::new(Narrowed { inner: cpu_backend(64, true), forks: true, shaped: false }),
        2,
        true,
        24,
        None,
    );
    assert_eq!(unshaped, plain);
    assert_eq!(none.spec.drafts, 0);
}

/// A grammar-like constraint whose next mask depends on the last token: a token whose residue
/// mod 3 equals the last one's is not allowed, nor the tokens of `banned`. It counts the drafts
/// it is made to follow and the tokens it accepts.
struct NoRepeatedResidue {
    last: Option<u32>,
    followed: Vec<Option<u32>>,
    banned: Vec<u32>,
    counts: Arc<Mutex<ConstraintCounts>>,
}

#[derive(Debug, Default, Clone)]
struct ConstraintCounts {
    followed: usize,
    accepted: usize,
}

impl TokenConstraint for NoRepeatedResidue {
    fn fill_mask(&mut self, mask: &mut [u32], _: Instant) -> Result<(), String> {
        for t in 0..mask.len() as u32 * 32 {
            let repeats = self.last.is_some_and(|l| l % 3 == t % 3);
            if !repeats && !self.banned.contains(&t) {
                mask[t as usize / 32] |= 1 << (t % 32);
            }
        }
        Ok(())
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        match self.last.is_some_and(|l| l % 3 == token % 3) || self.banned.contains(&token) {
            true => Err(format!("token {token} breaks the rule after {:?}", self.last)),
            false => {
                self.last = Some(token);
                self.counts.lock().unwrap().accepted += 1;
                Ok(())
            }
        }
    }

    fn follow(&mut self, token: u32) -> Result<(), String> {
        self.followed.push(self.last);
        self.last = Some(token);
        self.counts.lock().unwrap().followed += 1;
        Ok(())
    }

    fn rollback(&mut self, n: usize) {
        for _ in 0..n {
            self.last = self.followed.pop().expect("rolled back no more than followed");
        }
    }
}

/// Greedy requests under `NoRepeatedResidue` (one with a stop token, one with banned tokens, one
/// with `n = 2`) and a seeded sampled one.
fn constrained_requests(counts: &Arc<Mutex<ConstraintCounts>>) -> Vec<GenerateRequest> {
    let prompt = |len: usize, salt: u32| -> Vec<u32> {
        std::iter::once(0).chain((1..len as u32).map(|i| (i * 43 + salt * 7) % 500 + 2)).collect()
    };
    let rule = |banned: Vec<u32>| {
        let counts = counts.clone();
        Some(ConstraintFactory(Arc::new(move || {
            Box::new(NoRepeatedResidue { last: None, followed: vec![], banned: banned.clone(), counts: counts.clone() })
                as Box<dyn TokenConstraint>
        })))
    };
    let greedy = SamplingParams::greedy();
    vec![
        GenerateRequest { constraint: rule(vec![]), ..GenerateRequest::new(prompt(9, 1), greedy.clone(), 30) },
        GenerateRequest { constraint: rule(vec![17, 344]), ..GenerateRequest::new(prompt(23, 2), greedy.clone(), 28) },
        GenerateRequest {
            constraint: rule(vec![]),
            stop_token_ids: vec![201],
            ..GenerateRequest::new(prompt(12, 3), greedy.clone(), 40)
        },
        GenerateRequest { n: 2, constraint: rule(vec![5]), ..GenerateRequest::new(prompt(31, 4), greedy.clone(), 22) },
        GenerateRequest {
            seed: Some(3),
            constraint: rule(vec![]),
            ..GenerateRequest::new(prompt(6, 5), SamplingParams { temperature: 0.9, ..Default::default() }, 20)
        },
    ]
}

/// The index in `constrained_requests()` of the sampled request (compared by length).
const SAMPLED_CONSTRAINED: usize = 4;

/// Structured output drafts: each verify row draws under the mask after the drafts before it
/// (the engine follows the constraint along them and rolls it back). Greedy outputs equal the
/// plain engine's with the MTP layer's own drafts and with forced drafts that mostly stand (one
/// planted wrong every third step, often a token the rule forbids); the constraint is told
/// exactly the emitted tokens; a backend that does not verify shaped rows never drafts for them.
#[test]
fn constrained_requests_draft_under_a_mask_per_verify_row_and_stay_exact() {
    let counts = Arc::new(Mutex::new(ConstraintCounts::default()));
    let reqs = constrained_requests(&counts);
    let (plain, plain_stats) = run_these(reqs.clone(), Box::new(cpu_backend(64, false)), 0, true, 24, None);
    let emitted: usize = plain.iter().flatten().map(Vec::len).sum();
    assert_eq!(counts.lock().unwrap().accepted, emitted, "the plain engine accepts each emitted token");
    assert_eq!(counts.lock().unwrap().followed, 0);
    let exact = |o: &[Vec<Vec<u32>>]| {
        let mut o = o.to_vec();
        o[SAMPLED_CONSTRAINED] = o[SAMPLED_CONSTRAINED].iter().map(|t| vec![0; t.len()]).collect();
        o
    };
    let (own, own_stats) = run_these(reqs.clone(), Box::new(cpu_backend(64, true)), 2, true, 24, None);
    assert_eq!(exact(&own), exact(&plain));
    assert!(own_stats.spec.drafts > 0, "the constrained requests draft");
    for k in [1, 3] {
        *counts.lock().unwrap() = ConstraintCounts::default();
        let forced = ForcedDrafts::over(cpu_backend(64, true), references_of(&reqs, &plain));
        let (spec, stats) = run_these(reqs.clone(), Box::new(forced), k, true, 24, None);
        assert_eq!(exact(&spec), exact(&plain), "K = {k}");
        let c = counts.lock().unwrap().clone();
        let emitted: usize = spec.iter().flatten().map(Vec::len).sum();
        assert_eq!(c.accepted, emitted, "K = {k}: the constraint accepts the emitted tokens alone");
        assert!(c.followed > 0, "K = {k}: masks were computed along drafts");
        let s = &stats.spec;
        assert!(s.accepted_tokens * 2 > s.draft_tokens, "K = {k}: forced drafts mostly stand ({s:?})");
        assert!(s.accepted_tokens < s.draft_tokens, "K = {k}: the planted errors are rejected");
        assert!(stats.steps.steps < plain_stats.steps.steps, "K = {k}: standing drafts save steps");
    }
    let (unshaped, none) = run_these(
        reqs,
        Box::new(Narrowed { inner: cpu_backend(64, true), forks: true, shaped: false }),
        2,
        true,
        24,
        None,
    );
    assert_eq!(exact(&unshaped), exact(&plain));
    assert_eq!(none.spec.drafts, 0);
}

/// `NoRepeatedResidue` whose every mask takes `delay` (a grammar near its budget).
struct Slow {
    rule: NoRepeatedResidue,
    delay: Duration,
}

impl TokenConstraint for Slow {
    fn fill_mask(&mut self, mask: &mut [u32], deadline: Instant) -> Result<(), String> {
        std::thread::sleep(self.delay);
        self.rule.fill_mask(mask, deadline)
    }
    fn accept(&mut self, token: u32) -> Result<(), String> {
        self.rule.accept(token)
    }
    fn follow(&mut self, token: u32) -> Result<(), String> {
        self.rule.follow(token)
    }
    fn rollback(&mut self, n: usize) {
        self.rule.rollback(n)
    }
}

/// A request whose masks along its drafts take longer than `SLOW_LOOKAHEAD` (two rows of 6 ms)
/// stops drafting after its first verify step, so one slow grammar does not hold every step up
/// for K + 1 masks; a fast one beside it drafts on, and both outputs stay exact.
#[test]
fn a_grammar_too_slow_along_drafts_stops_drafting_and_both_stay_exact() {
    let (slow_counts, fast_counts) =
        (Arc::new(Mutex::new(ConstraintCounts::default())), Arc::new(Mutex::new(ConstraintCounts::default())));
    let prompt =
        |salt: u32| -> Vec<u32> { std::iter::once(0).chain((1..14).map(|i| (i * 43 + salt * 7) % 500 + 2)).collect() };
    let rule = |counts: &Arc<Mutex<ConstraintCounts>>| NoRepeatedResidue {
        last: None,
        followed: vec![],
        banned: vec![],
        counts: counts.clone(),
    };
    let reqs = |delay: Duration| {
        let (s, f) = (slow_counts.clone(), fast_counts.clone());
        let slow =
            ConstraintFactory(Arc::new(move || Box::new(Slow { rule: rule(&s), delay }) as Box<dyn TokenConstraint>));
        let fast = ConstraintFactory(Arc::new(move || Box::new(rule(&f)) as Box<dyn TokenConstraint>));
        vec![
            GenerateRequest { constraint: Some(slow), ..GenerateRequest::new(prompt(1), SamplingParams::greedy(), 24) },
            GenerateRequest { constraint: Some(fast), ..GenerateRequest::new(prompt(2), SamplingParams::greedy(), 24) },
        ]
    };
    let (plain, _) = run_these(reqs(Duration::ZERO), Box::new(cpu_backend(64, false)), 0, true, 24, None);
    *slow_counts.lock().unwrap() = ConstraintCounts::default();
    *fast_counts.lock().unwrap() = ConstraintCounts::default();
    let forced = ForcedDrafts::over(cpu_backend(64, true), references_of(&reqs(Duration::ZERO), &plain));
    let (spec, _) = run_these(reqs(Duration::from_millis(6)), Box::new(forced), 2, true, 24, None);
    assert_eq!(spec, plain);
    let (slow, fast) = (slow_counts.lock().unwrap().clone(), fast_counts.lock().unwrap().clone());
    assert!(slow.followed <= 2, "the slow grammar followed drafts of one step only ({slow:?})");
    assert!(fast.followed > 4, "the fast grammar drafts on ({fast:?})");
}

/// A backend whose steps take at least `every`, and `verify` more when they verify drafts (a
/// machine where a verify step costs 40% more than a plain one).
struct Paced<B> {
    inner: B,
    every: Duration,
    verify: Duration,
    pending: Option<(Arc<Vec<StepPlan>>, Instant)>,
}

impl<B: Backend> Backend for Paced<B> {
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn model_config(&self) -> &ModelConfig {
        self.inner.model_config()
    }
    fn cache_layouts(&self) -> Vec<CacheLayout> {
        self.inner.cache_layouts()
    }
    fn step_limits(&self) -> StepLimits {
        self.inner.step_limits()
    }
    fn verifies_sampled_drafts(&self) -> bool {
        self.inner.verifies_sampled_drafts()
    }
    fn verifies_shaped_drafts(&self) -> bool {
        self.inner.verifies_shaped_drafts()
    }
    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        self.pending = Some((plans.clone(), Instant::now()));
        self.inner.start_step(plans)
    }
    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        let out = self.inner.finish_step();
        let (plans, started) = self.pending.take().expect("a step was started");
        let verifies = plans.iter().flat_map(|p| &p.seqs).any(|s| s.drafts_fed() > 0);
        let until = started + self.every + if verifies { self.verify } else { Duration::ZERO };
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
        out
    }
}

/// The measured load rule (`spec_load_rule`): on a machine where a verify step costs 40% more
/// than a plain one, drafts that mostly stand keep the engine drafting (2+ tokens a row pay for
/// it) and the untrained MTP layer's own drafts, which almost never stand, stop it after the
/// first measurements; the outputs stay the plain engine's either way.
#[test]
fn the_measured_load_rule_drafts_where_drafts_stand_and_stops_where_they_do_not() {
    let reqs: Vec<GenerateRequest> = requests().into_iter().filter(|r| r.sampling.is_greedy()).take(4).collect();
    let (plain, _) = run_these(reqs.clone(), Box::new(cpu_backend(64, false)), 0, false, 64, None);
    let forced = ForcedDrafts::over(cpu_backend(64, true), references_of(&reqs, &plain));
    let (standing, kept) = run_ruled(&reqs, Box::new(paced(forced)), true);
    assert_eq!(standing, plain);
    let (own, stopped) = run_ruled(&reqs, Box::new(paced(cpu_backend(64, true))), true);
    assert_eq!(own, plain);
    let (kept, stopped) = (kept.spec.drafts, stopped.spec.drafts);
    eprintln!("verify rows: {kept} with standing drafts, {stopped} with the layer's own");
    assert!(
        kept > 3 * stopped.max(1),
        "standing drafts keep drafting ({kept} verify rows) where failing ones stop ({stopped})"
    );
}

/// A seeded sampled request drafts whatever the measured rule decides (which uniforms draw its
/// tokens depends on whether a step drafts), so its tokens are those of a server that always
/// drafts, beside greedy requests the rule stops drafting for.
#[test]
fn a_seeded_sampled_request_drafts_whatever_the_measured_rule_decides() {
    let mut reqs: Vec<GenerateRequest> = requests().into_iter().filter(|r| r.sampling.is_greedy()).take(3).collect();
    reqs.push(requests()[SAMPLED].clone());
    let (always, all) = run_ruled(&reqs, Box::new(paced(cpu_backend(64, true))), false);
    let (ruled, some) = run_ruled(&reqs, Box::new(paced(cpu_backend(64, true))), true);
    assert_eq!(always, ruled, "every output, the seeded sampled one's too");
    let (all, some) = (all.spec.drafts, some.spec.drafts);
    assert!(some < all, "the rule stopped the greedy requests drafting ({some} of {all} verify rows)");
}

/// `inner` on a machine where a plain step takes 5 ms and a verify step 7.
fn paced<B: Backend>(inner: B) -> Paced<B> {
    Paced { inner, every: Duration::from_millis(5), verify: Duration::from_millis(2), pending: None }
}

/// `reqs` at once, two drafts a step, without mixed steps, the measured load rule on or off.
fn run_ruled(reqs: &[GenerateRequest], backend: Box<dyn Backend>, rule: bool) -> (Vec<Vec<Vec<u32>>>, EngineStats) {
    let cfg = mla_engine::EngineConfig {
        mtp_drafts: 2,
        spec_load_rule: rule,
        mixed_steps: false,
        max_num_batched_tokens: 64,
        ..engine_config(MAX_LEN)
    };
    let engine = Engine::start(backend, cfg).unwrap();
    let mut streams: Vec<_> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    let outs = streams.iter_mut().map(|s| collect(s, 1).tokens).collect();
    wait_until("blocks freed", || engine.stats().kv_usage == 0.0);
    let stats = engine.stats();
    engine.shutdown(Duration::from_secs(1));
    (outs, stats)
}

/// Two DP-attention ranks of the CPU reference in one process, each with the MTP layer.
fn dp_attention_pair() -> mla_cpu::group::CpuGroupBackend {
    let (cfg, _) = fixture();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/v3_mtp");
    let weights: Arc<dyn mla_core::WeightSource + Send + Sync> = Arc::new(Checkpoint::open(&dir, &cfg).unwrap());
    mla_cpu::group::local_group(
        cfg,
        weights,
        mla_core::Parallel::from_flags(2, None, true).unwrap(),
        CacheLayout { block_size: BLOCK_SIZE, num_blocks: 32 },
        mla_core::KvCacheDtype::Auto,
        StepLimits::unlimited(),
        Duration::from_secs(600),
        true,
    )
    .unwrap()
}

/// DP-attention ranks step together, so one measured rule decides for both from their rows
/// together: on the paced machine the untrained layer's drafts stop drafting on both ranks, and
/// the outputs are one rank's without speculation either way.
#[test]
fn one_measured_rule_decides_for_every_dp_attention_rank() {
    let reqs: Vec<GenerateRequest> = requests().into_iter().filter(|r| r.sampling.is_greedy()).take(4).collect();
    let (plain, _) = run_these(reqs.clone(), Box::new(cpu_backend(64, false)), 0, false, 64, None);
    let (ruled, on) = run_ruled(&reqs, Box::new(paced(dp_attention_pair())), true);
    let (always, off) = run_ruled(&reqs, Box::new(paced(dp_attention_pair())), false);
    assert_eq!(ruled, plain);
    assert_eq!(always, plain);
    let (on, off) = (on.spec.drafts, off.spec.drafts);
    eprintln!("verify rows over both ranks: {on} with the rule, {off} without");
    assert!(3 * on < off, "the rule stopped drafting on both ranks ({on} verify rows against {off})");
}
