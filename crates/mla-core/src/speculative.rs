//! Verifying drafted tokens without changing what is generated (speculative decoding; issue 31).
//!
//! A draft model (DeepSeek-V3's MTP layer) proposes tokens `d_1..d_K`; one target step scores
//! them all. Greedy: `d_j` stands while it is the target's argmax, and the first miss is replaced
//! by that argmax, so the output is exactly the non-speculative one. Sampling: the rule of
//! Leviathan et al. and Chen et al. (2023): accept `d ~ q` with probability `min(1, p(d)/q(d))`,
//! otherwise draw from the residual `max(p - q, 0)` renormalised. Whatever `q` is, the token that
//! comes out is distributed exactly as `p`, so the output distribution is the target's; `q` only
//! decides how often the draft stands (`1 - TV(p, q)` on average, the most any rule can get).
//! `p` and `q` are the distributions after temperature, top-k, top-p and min-p
//! (`sampling::distribution`), so filtering applies to both sides alike.
//!
//! Each verdict takes two uniforms, from a seed the engine derives per output position, so a
//! seeded request reproduces its output. It is not the output of the same seed without
//! speculation (that one draws by inverse CDF from `p` alone); docs/speculative-decoding.md says
//! why, and what coupling would keep it.

pub mod lossless_check;

use crate::rng::SplitMix64;
use crate::sampling::Distribution;
use crate::step::plan::{SampleRequest, SampledToken, SeqStep, StepPlan};
use std::borrow::Cow;

/// What becomes of one drafted token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The draft stands; verification goes on with the next one.
    Accept,
    /// The draft is rejected and this token is emitted in its place; later drafts are dropped.
    Replace(u32),
}

/// One sequence's verification: the target's draw at each of its sampled rows (the last row, or
/// with drafts fed every row from the last emitted token on), and how many of them it emits
/// (the draw, and with drafts the ones that stood and the target's own choice after them).
#[derive(Debug, Default, Clone)]
pub struct Verified {
    pub choices: Vec<SampledToken>,
    pub emitted: usize,
}

impl Verified {
    /// The tokens the sequence emits this step.
    pub fn into_emitted(mut self) -> Vec<SampledToken> {
        self.choices.truncate(self.emitted);
        self.choices
    }
}

/// Greedy verification: the draft stands when it is the target's choice.
pub fn verify_greedy(target_choice: u32, draft: u32) -> Verdict {
    if target_choice == draft {
        Verdict::Accept
    } else {
        Verdict::Replace(target_choice)
    }
}

/// How many tokens a greedy verify step emits: `choices[j]` is the target's choice after the fed
/// token and `drafts[..j]`, and each choice stands while the draft before it was the choice.
pub fn greedy_emitted(choices: &[u32], drafts: &[u32]) -> usize {
    assert_eq!(choices.len(), drafts.len() + 1, "one choice per draft, and one after them");
    1 + choices.iter().zip(drafts).take_while(|&(&c, &d)| verify_greedy(c, d) == Verdict::Accept).count()
}

/// Sampled verification of `draft`, drawn from `q`, against the target distribution `p`, with
/// the two uniforms of `seed` (accept, then residual).
pub fn verify_sampled(p: &Distribution, q: &Distribution, draft: u32, seed: u64) -> Verdict {
    let mut rng = SplitMix64::new(seed);
    let (u_accept, u_residual) = (rng.next_f64(), rng.next_f64());
    let (pd, qd) = (p.prob(draft), q.prob(draft));
    // qd = 0 cannot happen for a draft drawn from q; treat it as "never proposed": reject.
    if qd > 0.0 && u_accept * qd < pd {
        return Verdict::Accept;
    }
    Verdict::Replace(residual(p, q).pick(u_residual))
}

/// `max(p - q, 0)` over p's candidates, renormalised; `p` itself when it is nowhere above `q`
/// (then `p == q` up to rounding and a rejection had probability 0).
pub fn residual(p: &Distribution, q: &Distribution) -> Distribution {
    // q by token, dense: a lookup per candidate of p (`Distribution::prob` scans, which over two
    // whole vocabularies is 10^10 steps).
    let size = q.tokens.iter().max().map_or(0, |&t| t as usize + 1);
    let mut q_of = vec![0.0; size];
    q.tokens.iter().zip(&q.probs).for_each(|(&t, &qt)| q_of[t as usize] = qt);
    let q_at = |t: u32| q_of.get(t as usize).copied().unwrap_or(0.0);
    let probs: Vec<f64> = p.tokens.iter().zip(&p.probs).map(|(&t, &pt)| (pt - q_at(t)).max(0.0)).collect();
    let total: f64 = probs.iter().sum();
    if total <= 0.0 {
        return p.clone();
    }
    Distribution { tokens: p.tokens.clone(), probs: probs.into_iter().map(|x| x / total).collect() }
}

/// Seed of verify row `row`'s draws in a step whose first row draws with `seed` (the engine's
/// seed for the step's first output position; row 0 keeps it, so a row without drafts draws as
/// without speculation).
pub fn row_seed(seed: u64, row: usize) -> u64 {
    match row {
        0 => seed,
        r => SplitMix64::new(seed ^ (r as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64(),
    }
}

/// The request verify row `row` draws with: the step's, whose penalties count the drafts before
/// the row as output (row `row` follows `drafts[..row]`), and whose structured-output mask is the
/// row's own (the engine fills one per verify row, the grammar advanced along the drafts before
/// it: `TokenMask::row`). `logit_bias` is the same on every row: a request drafts only past
/// `min_tokens`, where no row bans the stop tokens.
pub fn row_request<'a>(req: &'a SampleRequest, drafts: &[u32], row: usize) -> Cow<'a, SampleRequest> {
    let penalised = req.penalty.is_some();
    let masked = req.allowed.as_ref().is_some_and(|m| m.rows() > 1);
    if row == 0 || !(penalised || masked) {
        return Cow::Borrowed(req);
    }
    let mut r = req.clone();
    if let Some(history) = r.penalty.as_mut() {
        history.output.extend_from_slice(&drafts[..row]);
    }
    if let Some(mask) = r.allowed.as_mut() {
        *mask = mask.row(row);
    }
    Cow::Owned(r)
}

/// Seed of the `j`-th draft a step draws for a sequence whose step seed is `seed`: apart from
/// every row's seed, so a draft and the uniforms that verify it are independent.
pub fn draft_seed(seed: u64, j: usize) -> u64 {
    SplitMix64::new(seed ^ 0xA5A5_5A5A_C3C3_3C3C ^ (j as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9)).next_u64()
}

/// A draft's distribution `q` as verification sees it: the one it was drawn from, or, where
/// that is not kept (a draft chosen by other means), the point mass on the draft. Verifying
/// against the point mass (accept with `p(d)`, else draw from `p` without `d`) is exact for a
/// draft chosen any way at all independently of the verdict's uniforms, only less often accepted
/// than against the true `q`.
pub fn point_mass(draft: u32) -> Distribution {
    Distribution { tokens: vec![draft], probs: vec![1.0] }
}

/// The MTP layer's rows in the first pass after a step, for one sequence: one per fed position
/// whose next token is known by the end of the step (the next fed token, `next_token`, or the
/// step's own draw). A decode row that feeds drafts runs all `1 + drafts_fed` of them, whatever
/// stands: row `j` pairs position `context_len + j` with the target's choice there, which is the
/// next emitted token for every row up to the last one emitted; the rows after it write entries
/// of the MTP cache layer past the sequence's end, which the next step overwrites before any row
/// reads them. So the count is a function of the plan alone, known before anything is verified
/// (DP-attention ranks size their collectives with it, and the device needs no host decision).
pub fn first_pass_rows(s: &SeqStep) -> usize {
    match s.mtp {
        None => 0,
        Some(m) => s.tokens.len() - 1 + usize::from(m.next_token.is_some() || s.sample.is_some()),
    }
}

/// Whether `s` proposes drafts this step: it wants them and its first pass has a row to draw from.
pub fn drafts_from(s: &SeqStep) -> bool {
    s.mtp.is_some_and(|m| m.draft > 0) && first_pass_rows(s) > 0
}

/// Rows of each MTP pass `plan` makes: the first pass (`first_pass_rows` summed), then one row
/// per sequence still drafting in each further pass (pass `c` serves the sequences that want
/// more than `c` drafts). Empty for a plan without speculative decoding.
pub fn mtp_pass_rows(plan: &StepPlan) -> Vec<usize> {
    if !plan.has_speculative() {
        return vec![];
    }
    let passes = plan.seqs.iter().filter_map(|s| s.mtp).map(|m| m.draft.max(1)).max().unwrap_or(1);
    let mut rows = vec![plan.seqs.iter().map(first_pass_rows).sum()];
    for c in 1..passes {
        rows.push(plan.seqs.iter().filter(|s| drafts_from(s) && s.mtp.is_some_and(|m| m.draft > c)).count());
    }
    rows
}

/// Every rank's rows in every MTP pass of a step, `[pass][rank]`: under DP attention each rank
/// runs its own plan, and all of them make as many passes as the longest one, meeting in every
/// pass's FFN collectives (a rank with no rows in a pass still takes part). A pass in which no
/// rank has rows is left out on every rank alike. One plan (one rank, or tensor parallelism):
/// its own passes.
pub fn mtp_pass_counts(plans: &[StepPlan]) -> Vec<Vec<usize>> {
    let per_rank: Vec<Vec<usize>> = plans.iter().map(mtp_pass_rows).collect();
    let passes = per_rank.iter().map(Vec::len).max().unwrap_or(0);
    (0..passes)
        .map(|p| per_rank.iter().map(|r| r.get(p).copied().unwrap_or(0)).collect::<Vec<usize>>())
        .filter(|counts| counts.iter().any(|&c| c > 0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::distribution;
    use crate::step::plan::SamplingParams;

    /// Pearson's chi-square statistic of `counts` against probabilities `p` (same order).
    fn chi_square(counts: &[u64], p: &[f64]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts.iter().zip(p).map(|(&c, &pi)| (c as f64 - n as f64 * pi).powi(2) / (n as f64 * pi)).sum()
    }

    /// The chi-square quantile at 0.999 for 7 degrees of freedom (8 categories).
    const CHI2_7_999: f64 = 24.32;
    const VOCAB: usize = 8;
    const TRIALS: u64 = 40_000;

    fn dist(logits: &[f32]) -> Distribution {
        distribution(logits, &SamplingParams::default())
    }

    /// Output frequencies over `TRIALS` seeded rounds of: draw `d ~ q`, verify against `p` with
    /// `rule`, emit the accepted draft or the replacement. Indexed by token.
    fn run(
        p: &Distribution,
        q: &Distribution,
        rule: impl Fn(&Distribution, &Distribution, u32, u64) -> Verdict,
    ) -> (Vec<u64>, f64) {
        let mut counts = vec![0u64; VOCAB];
        let mut accepted = 0u64;
        for i in 0..TRIALS {
            let mut rng = SplitMix64::new(0x5EED_0000 + i);
            let d = q.pick(rng.next_f64());
            let out = match rule(p, q, d, rng.next_u64()) {
                Verdict::Accept => {
                    accepted += 1;
                    d
                }
                Verdict::Replace(t) => t,
            };
            counts[out as usize] += 1;
        }
        (counts, accepted as f64 / TRIALS as f64)
    }

    fn by_token(p: &Distribution) -> Vec<f64> {
        (0..VOCAB as u32).map(|t| p.prob(t)).collect()
    }

    /// A target and a draft that disagree in a realistic way: the same leader, shuffled tail,
    /// total variation 0.16 (acceptance 0.84, near what DeepSeek reports for its MTP).
    fn pair() -> (Distribution, Distribution) {
        let p = dist(&[2.0, 1.2, 0.9, 0.1, -0.3, -0.8, -1.5, -2.0]);
        let q = dist(&[2.2, 0.4, 1.3, 0.6, -1.2, -0.2, -1.0, -2.5]);
        (p, q)
    }

    #[test]
    fn sampled_verification_leaves_the_target_distribution_unchanged() {
        let (p, q) = pair();
        let tv: f64 = 0.5 * (0..VOCAB as u32).map(|t| (p.prob(t) - q.prob(t)).abs()).sum::<f64>();
        let (counts, acceptance) = run(&p, &q, verify_sampled);
        let stat = chi_square(&counts, &by_token(&p));
        eprintln!("exact rule: chi-square {stat:.1}, acceptance {acceptance:.4}, 1 - TV {:.4}", 1.0 - tv);
        assert!(stat < CHI2_7_999, "chi-square {stat:.1} over {counts:?}");
        // Acceptance is 1 - TV(p, q) in expectation (the optimum).
        assert!((acceptance - (1.0 - tv)).abs() < 0.01, "acceptance {acceptance:.3} against 1 - TV {:.3}", 1.0 - tv);
        // Against the draft's own distribution the same counts fail: the test can tell them apart.
        assert!(chi_square(&counts, &by_token(&q)) > 10.0 * CHI2_7_999);
    }

    /// The power of the test above: two plausible mistakes in the rule shift the output
    /// distribution, and the same number of trials catches each.
    #[test]
    fn a_planted_bias_in_the_rule_fails_the_same_test() {
        let (p, q) = pair();
        // Accepting a little too often (min(1, 1.2 p/q)).
        let generous = |p: &Distribution, q: &Distribution, d: u32, seed: u64| {
            let mut rng = SplitMix64::new(seed);
            if rng.next_f64() * q.prob(d) < 1.2 * p.prob(d) {
                Verdict::Accept
            } else {
                Verdict::Replace(residual(p, q).pick(rng.next_f64()))
            }
        };
        // Replacing from p instead of the residual.
        let from_p = |p: &Distribution, q: &Distribution, d: u32, seed: u64| {
            let mut rng = SplitMix64::new(seed);
            if rng.next_f64() * q.prob(d) < p.prob(d) {
                Verdict::Accept
            } else {
                Verdict::Replace(p.pick(rng.next_f64()))
            }
        };
        let target = by_token(&p);
        for (name, stat) in [
            ("generous acceptance", chi_square(&run(&p, &q, generous).0, &target)),
            ("replacement from p", chi_square(&run(&p, &q, from_p).0, &target)),
        ] {
            eprintln!("{name}: chi-square {stat:.1}");
            assert!(stat > CHI2_7_999, "{name}: chi-square {stat:.1} does not show the bias");
        }
    }

    #[test]
    fn identical_distributions_always_accept_and_greedy_takes_the_target_choice() {
        let (p, _) = pair();
        let (counts, acceptance) = run(&p, &p, verify_sampled);
        assert_eq!(acceptance, 1.0);
        assert!(chi_square(&counts, &by_token(&p)) < CHI2_7_999);
        assert_eq!(verify_greedy(3, 3), Verdict::Accept);
        assert_eq!(verify_greedy(3, 5), Verdict::Replace(3));
    }

    #[test]
    fn filtering_applies_to_both_sides() {
        // top-k 2 on the target: a draft outside its two candidates is always replaced, and by
        // one of them.
        let logits = [2.0, 1.5, 1.4, 0.0, -1.0, -1.0, -2.0, -3.0];
        let p = distribution(&logits, &SamplingParams { top_k: Some(2), ..Default::default() });
        let q = dist(&logits);
        for seed in 0..200 {
            match verify_sampled(&p, &q, 2, seed) {
                Verdict::Replace(t) => assert!(t == 0 || t == 1, "replaced by {t}"),
                Verdict::Accept => panic!("token 2 is outside the target's top 2"),
            }
        }
    }

    fn mtp_seq(tokens: usize, sample: bool, m: crate::step::plan::MtpStep) -> SeqStep {
        use crate::step::plan::{LogitsRequest, SampleRequest};
        SeqStep {
            fork: None,
            seq_id: 0,
            tokens: vec![1; tokens],
            context_len: 10,
            block_table: vec![0, 1],
            logits: LogitsRequest::None,
            sample: sample.then(|| SampleRequest::new(SamplingParams::greedy(), 0)),
            mtp: Some(m),
        }
    }

    #[test]
    fn mtp_passes_follow_from_the_plan_alone() {
        use crate::step::plan::{MtpStep, StepKind};
        let m = |drafts_fed, next_token, draft| MtpStep { drafts_fed, next_token, draft };
        // A middle prompt chunk of 5 with its successor: 5 rows, no draft. The last chunk of 3
        // (it samples): 3 rows, 2 drafts. A decode row feeding 2 drafts: all 3 rows, 3 drafts.
        // A decode row without MTP: none.
        let plan = StepPlan {
            kind: StepKind::Mixed { prefill: 2 },
            seqs: vec![
                mtp_seq(5, false, m(0, Some(7), 0)),
                mtp_seq(3, true, m(0, None, 2)),
                mtp_seq(3, true, m(2, None, 3)),
                SeqStep { mtp: None, ..mtp_seq(1, true, m(0, None, 0)) },
            ],
        };
        assert_eq!(plan.seqs.iter().map(first_pass_rows).collect::<Vec<_>>(), vec![5, 3, 3, 0]);
        assert_eq!(mtp_pass_rows(&plan), vec![11, 2, 1]);
        // A one-token chunk that neither samples nor knows its successor has no row, so it
        // cannot draft even if asked to.
        let lone = StepPlan { kind: StepKind::Prefill, seqs: vec![mtp_seq(1, false, m(0, None, 0))] };
        assert_eq!(mtp_pass_rows(&lone), vec![0]);
        assert!(!drafts_from(&lone.seqs[0]));
        let plain = StepPlan { kind: StepKind::Decode, seqs: vec![plan.seqs[3].clone()] };
        assert!(mtp_pass_rows(&plain).is_empty());

        // DP attention: every rank makes the longest plan's passes; a pass nobody has rows in
        // is left out everywhere.
        let idle = StepPlan { kind: StepKind::Decode, seqs: vec![] };
        let counts = mtp_pass_counts(&[plan.clone(), idle.clone(), plain.clone()]);
        assert_eq!(counts, vec![vec![11, 0, 0], vec![2, 0, 0], vec![1, 0, 0]]);
        let counts = mtp_pass_counts(&[lone, plan.clone()]);
        assert_eq!(counts, vec![vec![0, 11], vec![0, 2], vec![0, 1]]);
        assert!(mtp_pass_counts(&[idle, plain]).is_empty());
        assert_eq!(mtp_pass_counts(std::slice::from_ref(&plan)), vec![vec![11], vec![2], vec![1]]);
    }
}
