//! A statistical check any backend's tests run: sampled requests with speculative decoding are
//! lossless. Thousands of seeded runs of one prompt with drafts give the output tokens at
//! positions 1 and 2 with the frequencies the target model's own distribution predicts, computed
//! exactly by enumerating every earlier token (top-k 8 keeps that small, and asks the backend
//! itself for each distribution, so a bf16 backend is held to its own target). Pearson's
//! chi-square against those probabilities must stay under its 0.999 quantile:
//! - with the backend's own drafts, sampled from its MTP distribution `q` and verified against it
//!   (the rank keeps `q` from one step to the next);
//! - with drafts forced to the target's likeliest token, verified against their point masses, so
//!   that most of them stand and the accepting path is what is tested.
//!
//! A bf16 backend's target is enumerated by prefill rows, its output drawn by verify rows, and the
//! two round the same logits apart by a few hundredths: where a context's top-k boundary is that
//! close to a tie, the two can keep different tokens there (run S27: two tensor-parallel ranks
//! kept token 300 where the prefill left it out by 0.0002). Such a context's tokens near the
//! boundary are counted as one category (`Exact::pooled`), so rounding does not fail the check
//! and a rule that moved probability anywhere else still does.
//!
//! With `Setup::shaping` the requests carry penalties and a `logit_bias`: the target enumerated
//! is then each context's logits shaped as a draw there would shape them (the penalties count
//! the outputs before it), and the verify rows must shape theirs by the drafts before them.
//!
//! The check has power: the drafts themselves (what a rule that accepted every draft would emit)
//! must score far above the quantile at the same sample size. It lives here, not in a test
//! directory, so that the CPU reference and the CUDA backend are held to the same procedure.

use crate::rng::SplitMix64;
use crate::sampling::{distribution, shaped_logits, Distribution};
use crate::step::backend::Backend;
use crate::step::plan::{
    LogitsRequest, MtpStep, PenaltyTokens, SampleRequest, SamplingParams, SeqResult, SeqStep, StepKind, StepPlan,
};
use std::collections::{HashMap, HashSet};

/// Drafts per step.
pub const K: usize = 2;

/// What is checked: `runs` seeded runs of `prompt`, a sequence's blocks `table`.
pub struct Setup {
    pub prompt: Vec<u32>,
    pub table: Vec<u32>,
    pub runs: u64,
    /// How far apart the backend's prefill and verify rows may round one logit, twice over
    /// (`ROUNDING_BF16`, or a small figure for an f32 backend): the width of a near tie.
    pub rounding: f32,
    /// Penalties and a logit bias on every draw (`None`: plain draws).
    pub shaping: Option<Shaping>,
}

/// What shapes the logits of `Setup::shaping`'s draws.
#[derive(Debug, Clone, Default)]
pub struct Shaping {
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
}

fn params(setup: &Setup) -> SamplingParams {
    let plain = SamplingParams { temperature: 1.0, top_k: Some(8), ..Default::default() };
    match &setup.shaping {
        Some(s) => SamplingParams {
            repetition_penalty: s.repetition_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            ..plain
        },
        None => plain,
    }
}

/// The request of a draw after `output` (the output tokens before it) with `seed`.
fn request(setup: &Setup, output: &[u32], seed: u64) -> SampleRequest {
    let params = params(setup);
    let penalty =
        params.has_penalties().then(|| PenaltyTokens { prompt: setup.prompt.clone(), output: output.to_vec() });
    let logit_bias = setup.shaping.as_ref().map_or_else(Vec::new, |s| s.logit_bias.clone());
    SampleRequest { penalty, logit_bias, ..SampleRequest::new(params, seed) }
}

/// The seed of output position `i` of run `run`, as the engine derives one per position.
fn seed(run: u64, i: usize) -> u64 {
    SplitMix64::new(run.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64).next_u64()
}

/// `Setup::rounding` for a bf16 backend: a prefill row against a decode row of the same context
/// differed by up to 0.026 on one H200 and 0.027 on two tensor-parallel ranks (run S27, the
/// GPU fixture's bf16/FP8 model), so each logit is trusted to half of this.
pub const ROUNDING_BF16: f32 = 0.06;

/// A context whose top-k boundary is within rounding: which tokens top-k keeps there may differ
/// between the prefill that enumerated the target and the verify rows that sample the output.
#[derive(Debug, Clone)]
struct Boundary {
    context: Vec<u32>,
    /// The context's probability under the target (which output position it feeds: its length).
    weight: f64,
    /// The tokens that could cross the boundary: kept ones within rounding above the best one
    /// left out, and left-out ones within rounding below the last one kept.
    band: Vec<u32>,
    /// The probability the target gives the band's kept tokens in this context.
    band_p: f64,
}

/// The band of tokens around the top-`k` boundary of `logits` that rounding could move across
/// it: empty where the `k`-th logit is more than `rounding` above the `k+1`-th.
fn boundary_band(logits: &[f32], k: usize, rounding: f32) -> Option<Vec<u32>> {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let (last, out) = (logits[*idx.get(k.checked_sub(1)?)?], logits[*idx.get(k)?]);
    let kept = idx[..k].iter().filter(|&&i| logits[i] < out + rounding);
    let left = idx[k..].iter().take_while(|&&i| logits[i] > last - rounding);
    Some(kept.chain(left).map(|&i| i as u32).collect())
}

/// The target's distribution of the token after `tokens`, and its top-k boundary band.
fn next_distribution(b: &mut dyn Backend, setup: &Setup, tokens: &[u32]) -> (Distribution, Option<Vec<u32>>) {
    let s = SeqStep {
        fork: None,
        seq_id: 99,
        tokens: tokens.to_vec(),
        context_len: 0,
        block_table: setup.table.clone(),
        logits: LogitsRequest::Last,
        sample: None,
        mtp: None,
    };
    let r = b.step(&StepPlan { kind: StepKind::Prefill, seqs: vec![s] }).unwrap();
    let req = request(setup, &tokens[setup.prompt.len()..], 0);
    let logits = shaped_logits(&r.seqs[0].logits[0], &req).expect("no mask");
    let band = req.params.top_k.and_then(|k| boundary_band(&logits, k, setup.rounding));
    (distribution(&logits, &req.params), band)
}

/// The exact distributions of output positions 1 and 2, and of the next token given what came
/// before (for forcing likely drafts).
pub struct Exact {
    at1: HashMap<u32, f64>,
    at2: HashMap<u32, f64>,
    given: HashMap<Vec<u32>, Distribution>,
    /// The enumerated contexts whose top-k boundary is within rounding.
    boundaries: Vec<Boundary>,
}

/// Enumerates the target's distributions on `target` (a backend that need not draft).
pub fn exact(target: &mut dyn Backend, setup: &Setup) -> Exact {
    let (p0, _) = next_distribution(target, setup, &setup.prompt);
    let (mut at1, mut at2, mut given) = (HashMap::new(), HashMap::new(), HashMap::new());
    let mut boundaries = Vec::new();
    let mut note = |context: Vec<u32>, weight: f64, p: &Distribution, band: Option<Vec<u32>>| {
        if let Some(band) = band.filter(|band| !band.is_empty()) {
            let band_p = p.tokens.iter().zip(&p.probs).filter(|(t, _)| band.contains(t)).map(|(_, q)| q).sum();
            boundaries.push(Boundary { context, weight, band, band_p });
        }
    };
    for (&t0, &w0) in p0.tokens.iter().zip(&p0.probs) {
        let ctx0: Vec<u32> = setup.prompt.iter().copied().chain([t0]).collect();
        let (p1, b1) = next_distribution(target, setup, &ctx0);
        note(vec![t0], w0, &p1, b1);
        for (&t1, &w1) in p1.tokens.iter().zip(&p1.probs) {
            *at1.entry(t1).or_insert(0.0) += w0 * w1;
            let ctx1: Vec<u32> = ctx0.iter().copied().chain([t1]).collect();
            let (p2, b2) = next_distribution(target, setup, &ctx1);
            note(vec![t0, t1], w0 * w1, &p2, b2);
            for (&t2, &w2) in p2.tokens.iter().zip(&p2.probs) {
                *at2.entry(t2).or_insert(0.0) += w0 * w1 * w2;
            }
            given.insert(vec![t0, t1], p2);
        }
        given.insert(vec![t0], p1);
    }
    Exact { at1, at2, given, boundaries }
}

/// A step feeding `tokens` after `context_len` positions, the output so far being `output`.
fn step(setup: &Setup, tokens: Vec<u32>, context_len: usize, output: &[u32], seed: u64, fed: usize) -> SeqStep {
    SeqStep {
        fork: None,
        seq_id: 1,
        tokens,
        context_len,
        block_table: setup.table.clone(),
        logits: LogitsRequest::None,
        sample: Some(request(setup, output, seed)),
        mtp: Some(MtpStep { drafts_fed: fed, next_token: None, draft: K }),
    }
}

fn emitted(r: &SeqResult) -> Vec<u32> {
    r.sampled.iter().chain(&r.extra_tokens).map(|t| t.token).collect()
}

/// What the runs gave: per run the first three output tokens and the first draft the prefill
/// proposed; how many drafts were fed and how many stood.
#[derive(Default)]
pub struct Runs {
    outputs: Vec<[u32; 3]>,
    first_drafts: Vec<u32>,
    pub fed: usize,
    pub stood: usize,
}

/// The seeded runs on `b` (a backend that drafts `K`): `feed(out, own)` picks the drafts each
/// verify step feeds, from the output so far and the backend's own drafts.
fn run(b: &mut dyn Backend, setup: &Setup, mut feed: impl FnMut(&[u32], &[u32]) -> Vec<u32>) -> Runs {
    let mut runs = Runs::default();
    for r in 0..setup.runs {
        let prefill = step(setup, setup.prompt.clone(), 0, &[], seed(r, 0), 0);
        let first = b.step(&StepPlan { kind: StepKind::Prefill, seqs: vec![prefill] }).unwrap().seqs.remove(0);
        let mut out = emitted(&first);
        let mut own = first.drafts;
        assert_eq!(own.len(), K, "the prefill proposes {K} drafts");
        runs.first_drafts.push(own[0]);
        while out.len() < 3 {
            let drafts = feed(&out, &own);
            let tokens: Vec<u32> = std::iter::once(*out.last().unwrap()).chain(drafts.iter().copied()).collect();
            let context = setup.prompt.len() + out.len() - 1;
            let s = step(setup, tokens, context, &out, seed(r, out.len()), drafts.len());
            let res = b.step(&StepPlan { kind: StepKind::Decode, seqs: vec![s] }).unwrap().seqs.remove(0);
            let e = emitted(&res);
            assert!(!e.is_empty() && e.len() <= drafts.len() + 1);
            assert_eq!(e[..e.len() - 1], drafts[..e.len() - 1], "the tokens before the last are drafts that stood");
            runs.fed += drafts.len();
            runs.stood += e.len() - 1;
            out.extend(e);
            own = res.drafts;
        }
        runs.outputs.push([out[0], out[1], out[2]]);
    }
    runs
}

/// How often each token occurs in `samples`, and how many there are.
fn tally(samples: impl Iterator<Item = u32>) -> (HashMap<u32, u64>, u64) {
    let mut counts: HashMap<u32, u64> = HashMap::new();
    let mut n = 0u64;
    for t in samples {
        *counts.entry(t).or_insert(0) += 1;
        n += 1;
    }
    (counts, n)
}

/// Pearson's chi-square of `samples` against `p`, categories with an expected count under 5
/// pooled (with what `p` leaves out), and its degrees of freedom.
fn chi_square(samples: impl Iterator<Item = u32>, p: &HashMap<u32, f64>) -> (f64, usize) {
    let (counts, n) = tally(samples);
    let big: Vec<u32> = p.iter().filter(|(_, &q)| q * n as f64 >= 5.0).map(|(&t, _)| t).collect();
    let mut stat = 0.0;
    let (mut rest_count, mut rest_p) = (n, 1.0);
    for t in &big {
        let (c, e) = (counts.get(t).copied().unwrap_or(0), p[t] * n as f64);
        stat += (c as f64 - e).powi(2) / e;
        rest_count -= c;
        rest_p -= p[t];
    }
    let rest_e = rest_p.max(0.0) * n as f64;
    if rest_e >= 5.0 {
        stat += (rest_count as f64 - rest_e).powi(2) / rest_e;
        (stat, big.len())
    } else if rest_count as f64 <= rest_e + 10.0 {
        // The pooled rest is too rare to test on its own, and (nearly) empty as it should be.
        (stat, big.len().saturating_sub(1))
    } else {
        // Many samples where the target puts (almost) nothing: no distribution of its.
        (f64::INFINITY, big.len().saturating_sub(1))
    }
}

/// The chi-square distribution's 0.999 quantile (Wilson-Hilferty; within 1% from 5 degrees up).
fn quantile_999(df: usize) -> f64 {
    let (k, z) = (df as f64, 3.090);
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// The category that stands for every token of `Exact::pooled`.
const POOLED: u32 = u32::MAX;

impl Exact {
    /// The tokens of output position `pos` counted as one category over `runs` runs: the bands
    /// of the contexts feeding it (contexts of `pos` output tokens) whose top-k boundary is within
    /// rounding and that carry a sample's worth of the band (`weight * band_p * runs >= 1`).
    /// A swap across such a boundary moves probability between tokens of one band, which the
    /// pooled category does not see; everything else is tested as before. (A swap at position 1
    /// also feeds position 2 a context the enumeration did not visit; its weight is that of one
    /// band token, a few samples among thousands.)
    fn pooled(&self, pos: usize, runs: usize) -> HashSet<u32> {
        let carries = |b: &&Boundary| b.context.len() == pos && b.weight * b.band_p * runs as f64 >= 1.0;
        self.boundaries.iter().filter(carries).flat_map(|b| b.band.iter().copied()).collect()
    }
}

/// `p` with the tokens of `pooled` summed into `POOLED`.
fn pool(p: &HashMap<u32, f64>, pooled: &HashSet<u32>) -> HashMap<u32, f64> {
    let mut out = HashMap::new();
    for (&t, &q) in p {
        *out.entry(if pooled.contains(&t) { POOLED } else { t }).or_insert(0.0) += q;
    }
    out
}

/// The samples of one output position tested against the target, near-tie bands pooled.
struct Tested {
    stat: f64,
    df: usize,
    /// The tokens counted as one (`Exact::pooled`), ascending.
    band: Vec<u32>,
    /// The samples and the target's distribution, with the band's tokens as `POOLED`.
    samples: Vec<u32>,
    p: HashMap<u32, f64>,
}

/// Pearson's chi-square of `samples` at output position `pos` against `exact`'s target.
fn tested(samples: &[u32], pos: usize, exact: &Exact) -> Tested {
    let pooled = exact.pooled(pos, samples.len());
    let p = pool(if pos == 1 { &exact.at1 } else { &exact.at2 }, &pooled);
    let samples: Vec<u32> = samples.iter().map(|t| if pooled.contains(t) { POOLED } else { *t }).collect();
    let (stat, df) = chi_square(samples.iter().copied(), &p);
    let mut band: Vec<u32> = pooled.into_iter().collect();
    band.sort_unstable();
    Tested { stat, df, band, samples, p }
}

fn check(what: &str, runs: &Runs, exact: &Exact) {
    for pos in [1, 2] {
        let samples: Vec<u32> = runs.outputs.iter().map(|o| o[pos]).collect();
        let t = tested(&samples, pos, exact);
        let pooled = if t.band.is_empty() { String::new() } else { format!("; near-tie tokens {:?} as one", t.band) };
        let q = quantile_999(t.df);
        eprintln!(
            "{what}: position {pos}, chi-square {:.1} on {} degrees (0.999 quantile {q:.1}){pooled}",
            t.stat, t.df
        );
        if t.stat >= q {
            report_worst(t.samples.iter().copied(), &t.p);
        }
        assert!(t.stat < q, "{what}: position {pos} is not distributed as the target's");
    }
}

/// Prints the tokens whose counts stray furthest from what `p` expects (a failed check's why).
fn report_worst(samples: impl Iterator<Item = u32>, p: &HashMap<u32, f64>) {
    let (counts, n) = tally(samples);
    let mut tokens: Vec<u32> = counts.keys().chain(p.keys()).copied().collect();
    tokens.sort_unstable();
    tokens.dedup();
    let stray = |t: &u32| {
        let e = p.get(t).copied().unwrap_or(0.0) * n as f64;
        (counts.get(t).copied().unwrap_or(0) as f64 - e).abs() / e.max(1.0).sqrt()
    };
    tokens.sort_by(|a, b| stray(b).total_cmp(&stray(a)));
    for t in tokens.iter().take(6) {
        let e = p.get(t).copied().unwrap_or(0.0) * n as f64;
        let name = if *t == POOLED { "the near-tie tokens".to_string() } else { format!("token {t}") };
        eprintln!("  {name}: {} samples where the target expects {e:.1}", counts.get(t).copied().unwrap_or(0));
    }
}

/// The backend's own sampled drafts leave the output distribution unchanged, and the check can
/// tell the drafts from the target. Returns the runs (drafts fed and stood).
pub fn own_drafts(b: &mut dyn Backend, setup: &Setup, exact: &Exact) -> Runs {
    let own = run(b, setup, |_, own| own.to_vec());
    eprintln!("own drafts: {} of {} stood", own.stood, own.fed);
    assert!(own.fed >= setup.runs as usize, "the runs fed drafts");
    check("own drafts", &own, exact);
    let t = tested(&own.first_drafts, 1, exact);
    eprintln!("the first drafts as position 1: chi-square {:.1} on {} degrees", t.stat, t.df);
    assert!(t.stat > 10.0 * quantile_999(t.df), "the check cannot tell the drafts from the target");
    own
}

/// Drafts forced to the target's likeliest tokens stand often (at least half as many as there are
/// runs) and leave the output distribution unchanged. Returns the runs.
pub fn likely_drafts(b: &mut dyn Backend, setup: &Setup, exact: &Exact) -> Runs {
    // The target's likeliest next token given the output so far (and the drafts before it).
    let likeliest = |ctx: &[u32]| exact.given.get(ctx).map(|d| d.tokens[0]);
    let forced = run(b, setup, |out, _| {
        let mut ctx = out.to_vec();
        let mut drafts = vec![];
        while drafts.len() < K {
            match likeliest(&ctx) {
                Some(t) => {
                    drafts.push(t);
                    ctx.push(t);
                }
                None => break,
            }
        }
        drafts
    });
    eprintln!("forced likely drafts: {} of {} stood", forced.stood, forced.fed);
    // Half a run's worth of drafts stood at least: the accepting path carries a good part of
    // the sample (about 2,160 on the CPU fixture and 1,860 on the GPU one for 3,000 runs).
    assert!(
        forced.stood as u64 * 2 >= setup.runs,
        "too few forced drafts stood ({}) to test the accepting path",
        forced.stood
    );
    check("forced likely drafts", &forced, exact);
    forced
}

#[cfg(test)]
mod tests {
    use super::{boundary_band, pool, tested, Boundary, Exact, POOLED};
    use std::collections::{HashMap, HashSet};

    #[test]
    fn the_band_holds_the_tokens_rounding_could_move_across_the_boundary() {
        let (r, h) = (0.06, 0.03);
        // Top-2 keeps 1 and 3; 3 and 4 are within rounding of each other, 2 and 0 are not.
        let logits = [0.0, 3.0, 1.0, 2.0, 2.0 - h];
        assert_eq!(boundary_band(&logits, 2, r).unwrap(), vec![3, 4]);
        let band = boundary_band(&[0.0, 3.0, 1.0, 2.0, 1.5], 2, r).unwrap();
        assert!(band.is_empty(), "a gap wider than rounding is no tie");
        let band = boundary_band(&[2.0 + h, 2.0 + 3.0 * h, 2.0, 2.0 - h / 2.0], 2, r).unwrap();
        assert_eq!(band, vec![0, 2, 3], "kept tokens within rounding of the best left out join it");
        assert_eq!(boundary_band(&logits, 5, r), None, "nothing is left out");
        assert_eq!(boundary_band(&logits, 0, r), None);
    }

    #[test]
    fn pooling_sums_the_band_into_one_category() {
        let p: HashMap<u32, f64> = [(1, 0.5), (2, 0.3), (3, 0.2)].into_iter().collect();
        let pooled: HashSet<u32> = [2, 3, 9].into_iter().collect();
        let q = pool(&p, &pooled);
        assert_eq!(q.len(), 2);
        assert!((q[&super::POOLED] - 0.5).abs() < 1e-12 && q[&1] == 0.5);
    }

    /// Only contexts that carry a sample's worth of their band pool it, each at the output
    /// position it feeds; the pooled category is then tested like any other.
    #[test]
    fn bands_pool_where_they_carry_a_sample_at_the_position_they_feed() {
        let b =
            |context: Vec<u32>, weight: f64, band: Vec<u32>, band_p: f64| Boundary { context, weight, band, band_p };
        let exact = Exact {
            at1: [(5, 0.3), (6, 0.2), (9, 0.5)].into_iter().collect(),
            at2: HashMap::new(),
            given: HashMap::new(),
            boundaries: vec![
                b(vec![1], 0.1, vec![5, 6], 0.05),    // 15 samples' worth at 3,000 runs
                b(vec![2], 1e-4, vec![7], 0.01),      // 0.003: left alone
                b(vec![1, 3], 0.01, vec![8, 9], 0.1), // position 2's
            ],
        };
        let sorted = |h: HashSet<u32>| {
            let mut v: Vec<u32> = h.into_iter().collect();
            v.sort_unstable();
            v
        };
        assert_eq!(sorted(exact.pooled(1, 3000)), vec![5, 6]);
        assert_eq!(sorted(exact.pooled(2, 3000)), vec![8, 9]);
        assert!(exact.pooled(1, 100).is_empty(), "1.5 samples' worth at 3,000 runs is 0.05 at 100");
        // Samples that swap 5 for 6 (a near tie breaking the other way) are not seen ...
        let samples: Vec<u32> = (0..1000).map(|i| if i < 500 { 6 } else { 9 }).collect();
        let t = tested(&samples, 1, &exact);
        assert_eq!((t.band.clone(), t.df), (vec![5, 6], 1));
        assert!(t.stat < 1e-9 && t.samples.iter().filter(|&&x| x == POOLED).count() == 500);
        // ... but moving mass out of the band is.
        let skewed: Vec<u32> = (0..1000).map(|i| if i < 300 { 6 } else { 9 }).collect();
        assert!(tested(&skewed, 1, &exact).stat > 100.0);
    }
}
