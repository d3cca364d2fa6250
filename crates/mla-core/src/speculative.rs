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

use crate::rng::SplitMix64;
use crate::sampling::Distribution;

/// What becomes of one drafted token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The draft stands; verification goes on with the next one.
    Accept,
    /// The draft is rejected and this token is emitted in its place; later drafts are dropped.
    Replace(u32),
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
    let probs: Vec<f64> = p.tokens.iter().zip(&p.probs).map(|(&t, &pt)| (pt - q.prob(t)).max(0.0)).collect();
    let total: f64 = probs.iter().sum();
    if total <= 0.0 {
        return p.clone();
    }
    Distribution { tokens: p.tokens.clone(), probs: probs.into_iter().map(|x| x / total).collect() }
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
}
