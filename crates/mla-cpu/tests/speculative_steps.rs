//! Speculative decoding steps on the CPU reference backend (`SeqStep::mtp`), driven the way an
//! engine drives them, over the MTP fixtures (tests/fixtures/v3_mtp, v3_mtp_fp8):
//! - greedy output with the backend's own drafts, K = 1, 2 and 3, equals plain greedy decoding
//!   token for token;
//! - drafts forced from the reference continuation, with one wrong draft planted at each place,
//!   are accepted exactly up to the wrong one and the output still equals the reference (so
//!   the K+1-row verify step, acceptance and the overwrite of rejected rows are all exercised
//!   with real acceptances, which the fixture's untrained MTP layer rarely gives);
//! - each step's first draft is the argmax of the MTP oracle's row for that position wherever
//!   the output still follows the oracle's sequence, so the MTP layer's cache is kept right
//!   across prefill, verify steps and rejections.

use crate::common;

use mla_core::step::plan::{LogitsRequest, MtpStep, SampleRequest, SeqResult, SeqStep, StepKind, StepPlan};
use mla_core::{Backend, Checkpoint, ModelConfig, SamplingParams};
use mla_cpu::CpuBackend;

const BLOCK_SIZE: usize = 16;
const NEW_TOKENS: usize = 24;
/// The oracle's draft rows are compared where their top-2 gap is at least this.
const GAP_FLOOR: f32 = 1e-3;

/// A prompt, the oracle's teacher-forced sequence (prompt and continuation) and its draft
/// logits rows.
type OraclePrompt = (Vec<u32>, Vec<u32>, Vec<Vec<f32>>);

struct Fixture {
    cfg: ModelConfig,
    ckpt: Checkpoint,
    prompts: Vec<OraclePrompt>,
}

fn fixture(variant: &str) -> Fixture {
    let (cfg, ckpt, list) = common::mtp_oracles(variant);
    // The prompts are v3's (tests/fixtures/README.md): 5, 20 and 48 tokens.
    let prompt_len = |name: &str| match name {
        "short" => 5,
        "medium" => 20,
        "long" => 48,
        other => panic!("unknown prompt {other}"),
    };
    let prompts = list.into_iter().map(|o| (o.tokens[..prompt_len(&o.name)].to_vec(), o.tokens, o.draft)).collect();
    Fixture { cfg, ckpt, prompts }
}

fn backend(f: &Fixture, mtp: bool) -> CpuBackend {
    common::mtp_backend(&f.cfg, &f.ckpt, BLOCK_SIZE, 16, mtp)
}

fn table() -> Vec<u32> {
    // Reversed, so logical and physical order differ.
    (0..16u32).rev().collect()
}

fn run(b: &mut dyn Backend, kind: StepKind, s: SeqStep) -> SeqResult {
    b.step(&StepPlan { kind, seqs: vec![s] }).unwrap().seqs.remove(0)
}

fn greedy_step(tokens: Vec<u32>, context_len: usize, mtp: Option<MtpStep>) -> SeqStep {
    SeqStep {
        fork: None,
        seq_id: 1,
        tokens,
        context_len,
        block_table: table(),
        logits: LogitsRequest::None,
        sample: Some(SampleRequest::new(SamplingParams::greedy(), 0)),
        mtp,
    }
}

fn plain_greedy(f: &Fixture, prompt: &[u32]) -> Vec<u32> {
    let mut b = backend(f, false);
    let mut out = vec![run(&mut b, StepKind::Prefill, greedy_step(prompt.to_vec(), 0, None)).sampled.unwrap().token];
    while out.len() < NEW_TOKENS {
        let ctx = prompt.len() + out.len() - 1;
        out.push(
            run(&mut b, StepKind::Decode, greedy_step(vec![*out.last().unwrap()], ctx, None)).sampled.unwrap().token,
        );
    }
    out
}

/// What a speculative run saw: the output, per verify step how many drafts stood, and per step
/// (prefill included) the position its first draft is for and that draft.
struct Run {
    out: Vec<u32>,
    accepted: Vec<usize>,
    first_drafts: Vec<(usize, u32)>,
}

/// Two CPU ranks in one process with the MTP layer loaded: tensor parallel, or DP attention.
fn pair(f: &Fixture, dp_attention: bool) -> mla_cpu::group::CpuGroupBackend {
    let weights: std::sync::Arc<dyn mla_core::WeightSource + Send + Sync> =
        std::sync::Arc::new(Checkpoint::open(&common::fixture_dir("v3_mtp"), &f.cfg).unwrap());
    mla_cpu::group::local_group(
        f.cfg.clone(),
        weights,
        mla_core::Parallel::from_flags(2, None, dp_attention).unwrap(),
        mla_core::CacheLayout { block_size: BLOCK_SIZE, num_blocks: 16 },
        mla_core::KvCacheDtype::Auto,
        mla_core::StepLimits::unlimited(),
        std::time::Duration::from_secs(600),
        true,
    )
    .unwrap()
}

/// Greedy decoding with drafts: `feed(out, own)` picks the drafts a verify step feeds, from the
/// output so far and the backend's own drafts.
fn speculative(f: &Fixture, prompt: &[u32], k: usize, feed: impl FnMut(&[u32], &[u32]) -> Vec<u32>) -> Run {
    speculative_on(&mut backend(f, true), prompt, k, feed)
}

/// `speculative` on the backend `b` (which has the MTP layer loaded).
fn speculative_on(b: &mut dyn Backend, prompt: &[u32], k: usize, feed: impl FnMut(&[u32], &[u32]) -> Vec<u32>) -> Run {
    let mut d = Decoder::new(1, prompt, k, feed);
    while let Some((kind, s)) = d.next_step() {
        let r = run(b, kind, s);
        d.take(r);
    }
    d.finish()
}

/// One sequence decoded greedily with drafts, a step at a time (so several can share steps).
struct Decoder<'p, F> {
    id: u64,
    prompt: &'p [u32],
    k: usize,
    feed: F,
    /// The drafts fed in the step in flight.
    fed: Vec<u32>,
    out: Vec<u32>,
    own: Vec<u32>,
    log: Run,
}

impl<'p, F: FnMut(&[u32], &[u32]) -> Vec<u32>> Decoder<'p, F> {
    fn new(id: u64, prompt: &'p [u32], k: usize, feed: F) -> Self {
        let log = Run { out: vec![], accepted: vec![], first_drafts: vec![] };
        Decoder { id, prompt, k, feed, fed: vec![], out: vec![], own: vec![], log }
    }

    fn mtp(&self, drafts_fed: usize) -> Option<MtpStep> {
        Some(MtpStep { drafts_fed, next_token: None, draft: self.k })
    }

    /// The sequence's next step (`None` once it has its tokens).
    fn next_step(&mut self) -> Option<(StepKind, SeqStep)> {
        if self.out.is_empty() {
            let s = greedy_step(self.prompt.to_vec(), 0, self.mtp(0));
            return Some((StepKind::Prefill, SeqStep { seq_id: self.id, ..s }));
        }
        if self.out.len() >= NEW_TOKENS {
            return None;
        }
        let computed = self.prompt.len() + self.out.len() - 1;
        self.fed = (self.feed)(&self.out, &self.own);
        let tokens: Vec<u32> = std::iter::once(*self.out.last().unwrap()).chain(self.fed.iter().copied()).collect();
        let s = greedy_step(tokens, computed, self.mtp(self.fed.len()));
        Some((StepKind::Decode, SeqStep { seq_id: self.id, ..s }))
    }

    /// The result of the step `next_step` gave.
    fn take(&mut self, r: SeqResult) {
        assert_eq!(r.seq_id, self.id);
        let emitted: Vec<u32> = r.sampled.iter().chain(&r.extra_tokens).map(|t| t.token).collect();
        if self.out.is_empty() {
            assert_eq!(emitted.len(), 1, "a prompt step emits its draw alone");
        } else {
            let fed = self.fed.len();
            assert!(!emitted.is_empty() && emitted.len() <= fed + 1);
            let stood = emitted.len() - 1;
            assert_eq!(emitted[..stood], self.fed[..stood], "the tokens before the last are the drafts that stood");
            self.log.accepted.push(stood);
        }
        self.out.extend(&emitted);
        self.own = r.drafts;
        assert_eq!(self.own.len(), self.k);
        self.log.first_drafts.push((self.prompt.len() + self.out.len(), self.own[0]));
    }

    fn finish(mut self) -> Run {
        self.out.truncate(NEW_TOKENS);
        self.log.out = self.out;
        self.log
    }
}

/// `min_compared`: the FP8 model's greedy output leaves the oracle's sequence (v3's bf16
/// continuation) within a few tokens, so few of its drafts have an oracle row to meet; its drafts
/// are checked teacher-forced in tests/mtp_oracle.rs.
fn check_own_drafts(variant: &str, min_compared: usize) {
    let f = fixture(variant);
    let (mut compared, mut agreed) = (0, 0);
    for (prompt, oracle_seq, oracle_rows) in &f.prompts {
        let reference = plain_greedy(&f, prompt);
        for k in 1..=3 {
            let r = speculative(&f, prompt, k, |_, own| own.to_vec());
            assert_eq!(r.out, reference, "{variant}, prompt of {}, K = {k}", prompt.len());
            // The first draft for position p comes from the MTP row at p - 2; compare with the
            // oracle's while our sequence is still the oracle's up to p - 1.
            let full: Vec<u32> = prompt.iter().chain(&reference).copied().collect();
            for &(pos, draft) in &r.first_drafts {
                let row = pos - 2;
                if row >= oracle_rows.len()
                    || full.len() < pos
                    || full[..pos] != oracle_seq[..pos.min(oracle_seq.len())]
                {
                    continue;
                }
                let o = &oracle_rows[row];
                let mut sorted = o.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                if sorted[0] - sorted[1] < GAP_FLOOR {
                    continue;
                }
                compared += 1;
                agreed += usize::from(mla_core::sampling::argmax(o) == draft);
            }
        }
    }
    eprintln!("{variant}: {agreed} of {compared} first drafts are the oracle's argmax");
    assert!(compared >= min_compared, "too few drafts compared ({compared})");
    assert_eq!(agreed, compared, "{variant}: drafts differ from the MTP oracle's");
}

#[test]
fn greedy_with_own_drafts_equals_plain_greedy_and_drafts_follow_the_oracle() {
    check_own_drafts("v3_mtp", 100);
}

#[test]
fn greedy_with_own_drafts_equals_plain_greedy_fp8_weights() {
    check_own_drafts("v3_mtp_fp8", 3);
}

#[test]
fn forced_drafts_stand_exactly_up_to_the_first_wrong_one() {
    let f = fixture("v3_mtp");
    let (prompt, _, _) = &f.prompts[1];
    let reference = plain_greedy(&f, prompt);
    let vocab = f.cfg.vocab_size as u32;
    for k in 1..=3 {
        // Step i plants its wrong draft at place i mod (k + 1); place k means all are right.
        let mut step = 0;
        let mut expected = Vec::new();
        let r = speculative(&f, prompt, k, |out, _| {
            let wrong_at = step % (k + 1);
            step += 1;
            let mut drafts: Vec<u32> = (0..k).map(|j| reference.get(out.len() + j).copied().unwrap_or(0)).collect();
            if wrong_at < k {
                drafts[wrong_at] = (drafts[wrong_at] + 1) % vocab;
            }
            // Beyond the reference's end every draft is "right" by construction (0), so only
            // count steps wholly inside it.
            let inside = out.len() + k <= reference.len();
            expected.push(inside.then_some(wrong_at.min(k)));
            drafts
        });
        assert_eq!(r.out, reference, "K = {k}");
        let mut checked = 0;
        for (got, want) in r.accepted.iter().zip(&expected) {
            if let Some(want) = want {
                assert_eq!(got, want, "K = {k}: drafts stood {got} times, expected {want}");
                checked += 1;
            }
        }
        assert!(checked >= 4, "K = {k}: only {checked} steps checked");
        assert!(r.accepted.contains(&k), "K = {k}: no step accepted every draft");
    }
}

/// Two tensor-parallel ranks (an in-process collective) draft and verify as one rank does: the
/// same outputs and the same drafts at every step, K = 1 and 3.
#[test]
fn tensor_parallel_ranks_draft_and_verify_as_one_rank() {
    let f = fixture("v3_mtp");
    for k in [1, 3] {
        for (prompt, _, _) in &f.prompts {
            let one = speculative(&f, prompt, k, |_, own| own.to_vec());
            let mut group = pair(&f, false);
            let two = speculative_on(&mut group, prompt, k, |_, own| own.to_vec());
            assert_eq!(two.out, one.out, "K = {k}, prompt of {}", prompt.len());
            assert_eq!(two.first_drafts, one.first_drafts, "K = {k}, prompt of {}", prompt.len());
        }
    }
}

/// DP attention: each rank runs its own sequence with its own number of drafts, starting and
/// finishing at other steps than the other rank (so a rank is idle while the other drafts, or
/// makes fewer MTP passes), and every rank's output and drafts equal that sequence alone on one
/// rank. The ranks meet in every MTP pass's FFN collectives, with their own rows or none.
#[test]
fn dp_attention_ranks_draft_and_verify_as_one_rank_each() {
    let f = fixture("v3_mtp");
    let prompts: Vec<&[u32]> = f.prompts.iter().map(|(p, _, _)| p.as_slice()).collect();
    // (rank 0's prompt and K, rank 1's prompt and K, the step rank 1 starts at)
    for (a, ka, b, kb, delay) in [(0, 1, 1, 3, 2), (2, 3, 0, 1, 0), (1, 2, 2, 2, 5)] {
        let one_a = speculative(&f, prompts[a], ka, |_, own| own.to_vec());
        let one_b = speculative(&f, prompts[b], kb, |_, own| own.to_vec());
        let mut group = pair(&f, true);
        let own = |_: &[u32], own: &[u32]| own.to_vec();
        let mut ranks = [Decoder::new(1, prompts[a], ka, own), Decoder::new(2, prompts[b], kb, own)];
        let idle = StepPlan { kind: StepKind::Decode, seqs: vec![] };
        for step in 0.. {
            let plans: Vec<StepPlan> = ranks
                .iter_mut()
                .enumerate()
                .map(|(r, d)| match d.next_step() {
                    Some((kind, s)) if r == 0 || step >= delay => StepPlan { kind, seqs: vec![s] },
                    _ => idle.clone(),
                })
                .collect();
            if plans.iter().all(|p| p.seqs.is_empty()) {
                break;
            }
            let plans = std::sync::Arc::new(plans);
            group.start_step(&plans);
            let outs = group.finish_step().unwrap();
            for ((d, p), mut o) in ranks.iter_mut().zip(plans.iter()).zip(outs) {
                if !p.seqs.is_empty() {
                    d.take(o.seqs.remove(0));
                }
            }
        }
        let [two_a, two_b] = ranks.map(Decoder::finish);
        for (two, one, what) in [(two_a, one_a, "rank 0"), (two_b, one_b, "rank 1")] {
            assert_eq!(two.out, one.out, "{what}: K = {ka}/{kb}");
            assert_eq!(two.first_drafts, one.first_drafts, "{what}: K = {ka}/{kb}");
            assert_eq!(two.accepted, one.accepted, "{what}: K = {ka}/{kb}");
        }
    }
}

#[test]
fn steps_asking_what_cannot_be_verified_exactly_are_refused() {
    let f = fixture("v3_mtp");
    let mut b = backend(&f, true);
    let refused = |b: &mut CpuBackend, kind: StepKind, s: SeqStep, says: &str| {
        let e = b.step(&StepPlan { kind, seqs: vec![s] }).unwrap_err().to_string();
        assert!(e.contains(says), "{e}");
    };
    let mtp = |drafts_fed, draft| Some(MtpStep { drafts_fed, next_token: None, draft });
    refused(&mut b, StepKind::Prefill, greedy_step(vec![0, 5, 6], 0, mtp(1, 1)), "decode rows only");
    refused(&mut b, StepKind::Decode, greedy_step(vec![5, 6, 7], 0, mtp(1, 1)), "the drafts it verifies: 1), found 3");
    let mut masked = greedy_step(vec![5, 6], 0, mtp(1, 1));
    let words = vec![u32::MAX; mla_core::step::token_mask::mask_words(f.cfg.vocab_size)];
    masked.sample = Some(SampleRequest {
        allowed: Some(mla_core::step::token_mask::TokenMask::ready(words)),
        ..SampleRequest::new(SamplingParams::default(), 3)
    });
    refused(&mut b, StepKind::Decode, masked, "one row per verify row");
    let mut with_logits = greedy_step(vec![5, 6], 0, mtp(1, 1));
    with_logits.logits = LogitsRequest::All;
    refused(&mut b, StepKind::Decode, with_logits, "returns no logits");
    // Without the MTP layer loaded, any speculative step is refused.
    let mut plain = backend(&f, false);
    refused(&mut plain, StepKind::Prefill, greedy_step(vec![0, 5, 6], 0, mtp(0, 1)), "MTP layer is not loaded");
}

/// `SeqStep::fork`: a sequence that shares a prompt's computed blocks copies the block the
/// shared part ends in before computing the last prompt token there. Its token and drafts equal
/// those of a sequence that computed the whole prompt itself, so the copy carried every layer's
/// rows, the MTP layer's (which the drafts read) too; without the copy they do not. On one rank,
/// on two tensor-parallel ranks (each copies its own cache) and on the first of two DP-attention
/// ranks (the other idle), against the one-rank run.
#[test]
fn a_forked_block_carries_every_layers_rows_the_mtp_layers_too() {
    let f = fixture("v3_mtp");
    let (prompt, oracle_seq, _) = &f.prompts[1];
    let n = prompt.len();
    assert!(n > BLOCK_SIZE && n % BLOCK_SIZE != 1, "the shared part must end inside the second block");
    let step = |seq_id, tokens: Vec<u32>, context_len, block_table: Vec<u32>, fork, samples: bool| SeqStep {
        seq_id,
        tokens,
        context_len,
        block_table,
        logits: LogitsRequest::None,
        sample: samples.then(|| SampleRequest::new(SamplingParams::greedy(), 0)),
        mtp: Some(if samples {
            MtpStep { drafts_fed: 0, next_token: None, draft: 2 }
        } else {
            MtpStep { drafts_fed: 0, next_token: Some(prompt[n - 1]), draft: 0 }
        }),
        fork,
    };
    let token = |r: &SeqResult| r.sampled.as_ref().unwrap().token;
    let mut one_rank = None;
    for layout in ["one rank", "tp 2", "dp attention 2"] {
        let mut b: Box<dyn Backend> = match layout {
            "one rank" => Box::new(backend(&f, true)),
            "tp 2" => Box::new(pair(&f, false)),
            _ => Box::new(pair(&f, true)),
        };
        let ranks = b.cache_layouts().len();
        // Rank 0 runs `s`; any other attention rank is idle.
        let mut on_rank0 = |kind, s: SeqStep| {
            let mut plans = vec![StepPlan { kind, seqs: vec![s] }];
            plans.resize(ranks, StepPlan { kind: StepKind::Decode, seqs: vec![] });
            b.start_step(&std::sync::Arc::new(plans));
            b.finish_step().unwrap().remove(0).seqs.remove(0)
        };
        // Another sequence's rows in the blocks the forks go to, so an uncopied row is stale.
        let other: Vec<u32> = oracle_seq[..2 * BLOCK_SIZE].iter().rev().copied().collect();
        on_rank0(StepKind::Prefill, step(9, other, 0, vec![13, 12], None, false));
        // The whole prompt by itself.
        let whole = on_rank0(StepKind::Prefill, step(1, prompt.clone(), 0, vec![11, 10], None, true));
        // The shared part, then a fork of its second block computing the last prompt token.
        on_rank0(StepKind::Prefill, step(2, prompt[..n - 1].to_vec(), 0, vec![15, 14], None, false));
        let fork = Some(mla_core::step::plan::BlockFork { from: 14, to: 13 });
        let forked = on_rank0(StepKind::Prefill, step(3, vec![prompt[n - 1]], n - 1, vec![15, 13], fork, true));
        assert_eq!((token(&forked), &forked.drafts), (token(&whole), &whole.drafts), "{layout}");
        // The same step into block 12 without the copy reads the other sequence's rows.
        let stale = on_rank0(StepKind::Prefill, step(4, vec![prompt[n - 1]], n - 1, vec![15, 12], None, true));
        assert_ne!((token(&stale), &stale.drafts), (token(&whole), &whole.drafts), "{layout}: a missing copy shows");
        let got = (token(&whole), whole.drafts.clone());
        let first = one_rank.get_or_insert_with(|| got.clone());
        assert_eq!(&got, first, "{layout} against one rank");
    }
    assert_eq!(one_rank.unwrap().0, plain_greedy(&f, prompt)[0]);
}

/// A grammar's verify rows: each row draws under its own mask (the engine's mask after the
/// drafts before it). Two drafts that plain greedy decoding would emit are fed; the rows before
/// row `narrow` allow their draft alone, row `narrow` one other token alone, the rows after it
/// every token: the drafts stand up to that row, which emits its one token. Greedy, and sampled at temperature 1 (a draft its row's
/// mask forbids has probability 0 and is replaced from the masked row, whatever the uniforms).
#[test]
fn each_verify_row_draws_under_its_own_mask() {
    let f = fixture("v3_mtp");
    let (prompt, _, _) = &f.prompts[1];
    let reference = plain_greedy(&f, prompt);
    let vocab = f.cfg.vocab_size;
    let words = mla_core::step::token_mask::mask_words(vocab);
    let only = |t: u32| {
        let mut w = vec![0u32; words];
        w[t as usize / 32] = 1 << (t % 32);
        w
    };
    for params in [SamplingParams::greedy(), SamplingParams { temperature: 1.0, ..Default::default() }] {
        for narrow in 0..3 {
            let mut b = backend(&f, true);
            run(
                &mut b,
                StepKind::Prefill,
                greedy_step(prompt.clone(), 0, Some(MtpStep { drafts_fed: 0, next_token: None, draft: 2 })),
            );
            // Rows before it allow their draft alone (so a sampled draw accepts it surely).
            let other = (reference[narrow + 1] + 1) % vocab as u32;
            let mut rows = vec![u32::MAX; 3 * words];
            for (j, chunk) in rows.chunks_mut(words).enumerate().take(narrow + 1) {
                chunk.copy_from_slice(&only(if j == narrow { other } else { reference[j + 1] }));
            }
            let (mask, writer) = mla_core::step::token_mask::TokenMask::pending_rows(3);
            writer.fill(rows);
            let mut s = greedy_step(
                reference[..3].to_vec(),
                prompt.len(),
                Some(MtpStep { drafts_fed: 2, next_token: None, draft: 2 }),
            );
            s.sample = Some(SampleRequest { allowed: Some(mask), ..SampleRequest::new(params.clone(), 11) });
            let r = run(&mut b, StepKind::Decode, s);
            let emitted: Vec<u32> = r.sampled.iter().chain(&r.extra_tokens).map(|t| t.token).collect();
            let mut want = reference[1..1 + narrow].to_vec();
            want.push(other);
            assert_eq!(emitted, want, "row {narrow} allows {other} alone, t = {}", params.temperature);
        }
    }
}
