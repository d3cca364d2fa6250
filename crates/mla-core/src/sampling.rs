//! The host reference sampler (the parameters it reads are plain data in `plan.rs`).
//!
//! Order of operations follows vLLM: penalties, then temperature (0 means greedy), then top-k,
//! top-p and min-p filtering, then one draw from the renormalised distribution. Logit bias and the
//! structured-output mask come first of all (a banned token must stay banned whatever the
//! penalties do). Log-probabilities returned to users are of the unmodified model distribution.

use crate::rng::SplitMix64;
use crate::step::plan::{PenaltyTokens, RowScore, SampleRequest, SampledToken, SamplingParams};
use crate::step::token_mask::{allows, MaskError, MASK_WAIT};

/// Log-softmax in f64 for stability, returned as f32.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&x| (x as f64 - lse) as f32).collect()
}

/// Index of the largest value; the lowest index wins a tie (as `torch.argmax`).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// The `k` largest entries as (index, value), best first, ties broken by lower index. Small `k`
/// (logprobs, prompt logprobs: called per token on the engine thread) keeps a sorted list of `k`
/// in one pass instead of an index array the size of the vocabulary.
pub fn top_k_entries(values: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(values.len());
    if k == 0 {
        return vec![];
    }
    // a before b: larger value first, then lower index (the order `torch.topk` ties resolve to).
    let before = |a: (u32, f32), b: (u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)).is_lt();
    if k <= SMALL_TOP_K {
        let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
        for (i, &v) in values.iter().enumerate() {
            let e = (i as u32, v);
            if best.len() == k && !before(e, best[k - 1]) {
                continue;
            }
            let at = best.partition_point(|&b| before(b, e));
            best.insert(at, e);
            best.truncate(k);
        }
        return best;
    }
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| values[*b as usize].total_cmp(&values[*a as usize]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, values[i as usize])).collect()
}

/// Up to this `k` `top_k_entries` selects in one pass without a vocabulary-sized index array.
const SMALL_TOP_K: usize = 64;

/// Applies presence, frequency and repetition penalties in place.
pub fn apply_penalties(logits: &mut [f32], params: &SamplingParams, history: &PenaltyTokens) {
    if params.repetition_penalty != 1.0 {
        let mut seen = vec![false; logits.len()];
        for &t in history.prompt.iter().chain(&history.output) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        for (l, s) in logits.iter_mut().zip(seen) {
            if s {
                *l = if *l > 0.0 { *l / params.repetition_penalty } else { *l * params.repetition_penalty };
            }
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &t in &history.output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.frequency_penalty * c as f32 + params.presence_penalty;
            }
        }
    }
}

/// Adds `bias` to the logits and sends every token `allowed` refuses to `-inf`.
pub fn apply_shaping(logits: &mut [f32], bias: &[(u32, f32)], allowed: Option<&[u32]>) {
    for &(t, b) in bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
    if let Some(words) = allowed {
        for (t, l) in logits.iter_mut().enumerate() {
            if !allows(words, t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// Draws one token from `logits` (one row of `vocab_size`) as `req` asks. Fails only when the
/// request's structured-output mask never arrives or does not fit the vocabulary.
pub fn sample(logits: &[f32], req: &SampleRequest) -> Result<SampledToken, MaskError> {
    let (logprob, top_logprobs, raw_lp) = match req.top_logprobs {
        Some(k) => {
            let lp = log_softmax(logits);
            let top = top_k_entries(&lp, k);
            (0.0, top, Some(lp))
        }
        None => (0.0, vec![], None),
    };
    let p = &req.params;
    let work = shaped_logits(logits, req)?;
    let token = if p.is_greedy() { argmax(&work) } else { draw(&work, p, req.seed) };
    let logprob = raw_lp.map_or(logprob, |lp| lp[token as usize]);
    Ok(SampledToken { token, logprob, top_logprobs })
}

/// `logits` as `req` changes them before its draw: `logit_bias`, the structured-output mask, then
/// the penalties over its history. The distribution a draw comes from is these logits' under
/// `req.params` (`distribution`).
pub fn shaped_logits(logits: &[f32], req: &SampleRequest) -> Result<Vec<f32>, MaskError> {
    let mut work = logits.to_vec();
    if req.shapes_logits() {
        let words = req.allowed.as_ref().map(|m| m.wait(logits.len(), MASK_WAIT)).transpose()?;
        apply_shaping(&mut work, &req.logit_bias, words.as_deref());
    }
    if let Some(h) = &req.penalty {
        apply_penalties(&mut work, &req.params, h);
    }
    Ok(work)
}

/// `token`'s score under `logits` (`LogitsRequest::Scored`): its log-probability, rank and the
/// `k` most likely tokens. Prompt logprobs score every prompt position this way, so it makes one
/// pass for the normaliser (as `log_softmax` computes it, in f64) and one for the rank, and
/// normalises only the values it returns. The CUDA backend scores on the device instead
/// (kernels/sampling.cu, `score_rows`), held to this.
pub fn score(logits: &[f32], token: u32, k: usize) -> RowScore {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    let logprob = |x: f32| (x as f64 - lse) as f32;
    let own = logits[token as usize];
    let rank = 1 + logits.iter().filter(|&&x| x > own).count() as u32;
    let top = top_k_entries(logits, k).into_iter().map(|(id, x)| (id, logprob(x))).collect();
    RowScore { logprob: logprob(own), rank, top }
}

/// The scores `LogitsRequest::Scored` asks of a sequence's fed `rows` of logits (one per fed
/// token): row `i` against fed token `i + 1`, the last against `after` where there is one.
pub fn score_rows(rows: &[Vec<f32>], tokens: &[u32], top: u32, after: Option<u32>) -> Vec<RowScore> {
    let next = tokens.iter().skip(1).copied().chain(after);
    rows.iter().zip(next).map(|(r, t)| score(r, t, top as usize)).collect()
}

/// `token` reported as `sample` would report a draw of it from `logits`: with its log-probability
/// and the top alternatives when `req` asks for them. Speculative decoding emits tokens that
/// verification chose (a draft that stood, a residual draw) rather than `sample`.
pub fn report(logits: &[f32], req: &SampleRequest, token: u32) -> SampledToken {
    match req.top_logprobs {
        Some(k) => {
            let lp = log_softmax(logits);
            SampledToken { token, logprob: lp[token as usize], top_logprobs: top_k_entries(&lp, k) }
        }
        None => SampledToken { token, logprob: 0.0, top_logprobs: vec![] },
    }
}

fn draw(logits: &[f32], p: &SamplingParams, seed: u64) -> u32 {
    let d = distribution(logits, p);
    d.pick(SplitMix64::new(seed).next_f64())
}

/// The distribution a draw picks from once temperature, top-k, top-p and min-p have been
/// applied: the kept candidates, most likely first, with probabilities summing to 1 (up to
/// rounding). Speculative decoding compares the target's and the draft's.
#[derive(Debug, Clone, PartialEq)]
pub struct Distribution {
    pub tokens: Vec<u32>,
    pub probs: Vec<f64>,
}

impl Distribution {
    /// The token at quantile `u` in [0, 1) of the candidates in their order (the last one if
    /// rounding leaves `u` past the sum).
    pub fn pick(&self, u: f64) -> u32 {
        let total: f64 = self.probs.iter().sum();
        let u = u * total;
        let mut acc = 0.0;
        for (&tok, q) in self.tokens.iter().zip(&self.probs) {
            acc += q;
            if u < acc {
                return tok;
            }
        }
        *self.tokens.last().expect("a distribution keeps at least one candidate")
    }

    /// Probability of `token` (0 when it was filtered out).
    pub fn prob(&self, token: u32) -> f64 {
        self.tokens.iter().position(|&t| t == token).map_or(0.0, |i| self.probs[i])
    }
}

/// `logits` (already shaped and penalised) as the sampler's distribution for non-greedy `p`.
pub fn distribution(logits: &[f32], p: &SamplingParams) -> Distribution {
    let n = logits.len();
    let inv_t = 1.0 / p.temperature as f64;
    if p.top_k.is_none() && n > RANKED {
        if let Some(d) = unranked_tail(logits, p, inv_t) {
            return d;
        }
    }
    // Candidates sorted by descending logit; filtering only ever keeps a prefix of this order.
    let k = p.top_k.unwrap_or(n).clamp(1, n);
    let cand = top_k_entries(logits, k);
    let max = cand[0].1 as f64 * inv_t;
    let probs: Vec<f64> = cand.iter().map(|&(_, l)| (l as f64 * inv_t - max).exp()).collect();
    let total: f64 = probs.iter().sum();
    filtered(cand, probs, total, p, true).expect("the whole ranking holds every cut")
}

/// Candidates ranked exactly in a distribution without top-k over a large vocabulary; the rest
/// follow in token order. Sorting 129k logits took milliseconds per row, which a speculative
/// step spends per draft and per verified row on the host.
const RANKED: usize = 1024;

/// The distribution without top-k from its `RANKED` best candidates: top-p and min-p keep a
/// prefix of the ranking, which is exact whenever that prefix lies within the ranked head (the
/// head's mass reaches `top_p`, or its last candidate is under min-p's floor). Without either
/// filter every candidate is kept: the head in rank, then the rest in token order, the same
/// probabilities as a full sort gives (the order only decides which token a given uniform maps
/// to). `None` when a filter cuts past the head: the caller ranks everything.
fn unranked_tail(logits: &[f32], p: &SamplingParams, inv_t: f64) -> Option<Distribution> {
    let head = top_k_entries(logits, RANKED);
    let max = head[0].1 as f64 * inv_t;
    let weight = |l: f32| (l as f64 * inv_t - max).exp();
    let total: f64 = logits.iter().map(|&l| weight(l)).sum();
    let probs: Vec<f64> = head.iter().map(|&(_, l)| weight(l)).collect();
    if p.top_p < 1.0 || p.min_p > 0.0 {
        return filtered(head, probs, total, p, false);
    }
    let mut ranked = vec![false; logits.len()];
    head.iter().for_each(|&(t, _)| ranked[t as usize] = true);
    let rest = (0..logits.len() as u32).filter(|&t| !ranked[t as usize]);
    let tokens: Vec<u32> = head.iter().map(|&(t, _)| t).chain(rest).collect();
    let probs = tokens.iter().map(|&t| weight(logits[t as usize]) / total).collect();
    Some(Distribution { tokens, probs })
}

/// Top-p and min-p over ranked candidates `cand` with unnormalised weights `probs` (`total`
/// over the whole vocabulary), renormalised. `whole`: `cand` holds every candidate; otherwise
/// `None` unless a filter cuts within `cand` (the cut may lie past it).
fn filtered(
    cand: Vec<(u32, f32)>,
    mut probs: Vec<f64>,
    total: f64,
    p: &SamplingParams,
    whole: bool,
) -> Option<Distribution> {
    probs.iter_mut().for_each(|x| *x /= total);
    let (mut keep, mut cut) = (probs.len(), false);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        if let Some(i) = probs.iter().position(|&q| {
            acc += q;
            acc >= p.top_p as f64
        }) {
            (keep, cut) = (i + 1, true);
        }
    }
    if p.min_p > 0.0 {
        let floor = probs[0] * p.min_p as f64;
        let above = probs.iter().take_while(|&&q| q >= floor).count().max(1);
        if above < keep {
            (keep, cut) = (above, true);
        }
    }
    if !whole && !cut {
        return None;
    }
    probs.truncate(keep);
    let kept: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= kept);
    Some(Distribution { tokens: cand[..keep].iter().map(|&(t, _)| t).collect(), probs })
}

#[cfg(test)]
mod tests {

    #[test]
    fn score_matches_log_softmax() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1013) as f32 / 97.0).collect();
        let lp = log_softmax(&logits);
        let s = score(&logits, 5, 4);
        assert_eq!(s.logprob, lp[5]);
        assert_eq!(s.top, top_k_entries(&lp, 4));
        let s = score(&[1.0, 2.0, 3.0], 0, 2);
        let z = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((s.logprob as f64 - (1.0 - z)).abs() < 1e-6);
        assert_eq!(s.rank, 3);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
    }

    #[test]
    fn scored_rows_take_the_next_fed_token_then_the_one_after() {
        let rows = vec![vec![0.0, 1.0, 2.0], vec![2.0, 1.0, 0.0], vec![1.0, 2.0, 0.5]];
        let got = score_rows(&rows, &[2, 1, 0], 1, Some(2));
        let want: Vec<RowScore> = [(0, 1), (1, 0), (2, 2)].iter().map(|&(r, t)| score(&rows[r], t, 1)).collect();
        assert_eq!(got, want);
        assert_eq!(score_rows(&rows, &[2, 1, 0], 1, None).len(), 2, "no token after the last row: unscored");
    }

    use super::*;

    fn req(params: SamplingParams, seed: u64) -> SampleRequest {
        SampleRequest { params, seed, top_logprobs: None, penalty: None, logit_bias: Vec::new(), allowed: None }
    }

    #[test]
    fn greedy_takes_the_argmax_and_reports_logprobs() {
        let logits = [0.5, 2.0, -1.0, 2.0];
        let mut r = req(SamplingParams::greedy(), 0);
        r.top_logprobs = Some(2);
        let s = sample(&logits, &r).unwrap();
        assert_eq!(s.token, 1);
        // Hand-computed: log(e^2 / (e^0.5 + 2e^2 + e^-1)).
        let z = 0.5f64.exp() + 2.0 * 2f64.exp() + (-1f64).exp();
        assert!((s.logprob as f64 - (2f64.exp() / z).ln()).abs() < 1e-6);
        assert_eq!(s.top_logprobs.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
    }

    /// Without top-k a large vocabulary is ranked only in its head: the same candidates with the
    /// same probabilities as the full ranking (top-k = the vocabulary), in the same order as far
    /// as it ranks, whether a filter cuts within the head or past it (then everything is ranked).
    #[test]
    fn a_large_vocabulary_ranks_only_the_head_and_keeps_every_probability() {
        // Distinct logits (7919 is prime to 5,000): peaked (the head holds 98% of the mass at
        // temperature 1) and flat (about 20%).
        let peaked: Vec<f32> = (0..5000u32).map(|i| ((i * 7919) % 5000) as f32 / 250.0).collect();
        let flat: Vec<f32> = (0..5000u32).map(|i| ((i * 7919) % 5000) as f32 / 5000.0).collect();
        for logits in [&peaked, &flat] {
            for (top_p, min_p) in [(1.0, 0.0), (0.9, 0.0), (0.999, 0.0), (1.0, 0.05), (1.0, 0.9), (0.5, 0.5)] {
                for temperature in [0.7, 1.0, 1.5] {
                    let p = SamplingParams { temperature, top_p, min_p, ..Default::default() };
                    let fast = distribution(logits, &p);
                    let full = distribution(logits, &SamplingParams { top_k: Some(logits.len()), ..p.clone() });
                    let case = format!("top_p {top_p}, min_p {min_p}, temperature {temperature}");
                    assert_eq!(fast.tokens.len(), full.tokens.len(), "{case}");
                    let ranked = full.tokens.len().min(RANKED);
                    assert_eq!(fast.tokens[..ranked], full.tokens[..ranked], "{case}");
                    let fast_of: std::collections::HashMap<u32, f64> =
                        fast.tokens.iter().copied().zip(fast.probs.iter().copied()).collect();
                    for (&t, &q) in full.tokens.iter().zip(&full.probs) {
                        assert!((fast_of[&t] - q).abs() < 1e-12, "{case}: token {t}");
                    }
                }
            }
        }
    }

    #[test]
    fn top_k_entries_small_and_large_k_agree_with_a_full_sort() {
        // Ties (many equal values), negative zero, and k on both sides of SMALL_TOP_K.
        let values: Vec<f32> = (0..5000u32).map(|i| ((i * 7919) % 97) as f32 / 8.0 - 6.0).chain([0.0, -0.0]).collect();
        let mut order: Vec<u32> = (0..values.len() as u32).collect();
        order.sort_by(|a, b| values[*b as usize].total_cmp(&values[*a as usize]).then(a.cmp(b)));
        for k in [1, 2, 20, SMALL_TOP_K, SMALL_TOP_K + 1, 300] {
            let want: Vec<(u32, f32)> = order[..k].iter().map(|&i| (i, values[i as usize])).collect();
            assert_eq!(top_k_entries(&values, k), want, "k = {k}");
        }
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_reproduce() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplingParams { top_k: Some(1), ..Default::default() };
        assert_eq!(sample(&logits, &req(p, 9)).unwrap().token, argmax(&logits));
        let p = SamplingParams::default();
        let a: Vec<u32> = (0..20).map(|s| sample(&logits, &req(p.clone(), s)).unwrap().token).collect();
        let b: Vec<u32> = (0..20).map(|s| sample(&logits, &req(p.clone(), s)).unwrap().token).collect();
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "different seeds should give different draws");
    }

    #[test]
    fn sampling_frequencies_follow_the_distribution() {
        // p = softmax([ln 1, ln 3]) = [0.25, 0.75].
        let logits = [0.0f32, 3f32.ln()];
        let n = 20_000;
        let ones = (0..n).filter(|&s| sample(&logits, &req(SamplingParams::default(), s)).unwrap().token == 1).count();
        let frac = ones as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.015, "{frac}");
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // probs 0.5, 0.3, 0.2 (temperature 1).
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let p = SamplingParams { top_p: 0.6, ..Default::default() };
        assert!((0..500).all(|s| sample(&logits, &req(p.clone(), s)).unwrap().token <= 1));
        let p = SamplingParams { min_p: 0.5, ..Default::default() };
        assert!((0..500).all(|s| sample(&logits, &req(p.clone(), s)).unwrap().token <= 1));
        let p = SamplingParams { min_p: 0.7, ..Default::default() };
        assert!((0..500).all(|s| sample(&logits, &req(p.clone(), s)).unwrap().token == 0));
    }

    #[test]
    fn penalties_follow_vllm_definitions() {
        let mut logits = vec![2.0f32, -2.0, 1.0, 0.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..Default::default()
        };
        let h = PenaltyTokens { prompt: vec![0], output: vec![1, 2, 2] };
        apply_penalties(&mut logits, &p, &h);
        assert_eq!(logits, vec![1.0, -4.0 - 0.75, 0.5 - 1.25, 0.0]);
    }

    #[test]
    fn bias_and_mask_steer_the_draw_but_not_the_reported_logprobs() {
        use crate::step::token_mask::TokenMask;
        let logits = [3.0f32, 1.0, 0.5, 2.0];
        let mut r = req(SamplingParams::greedy(), 0);
        r.top_logprobs = Some(1);
        r.logit_bias = vec![(2, 10.0)];
        let s = sample(&logits, &r).unwrap();
        assert_eq!(s.token, 2, "a +10 bias makes token 2 the argmax");
        let raw = log_softmax(&logits);
        assert_eq!(s.logprob, raw[2], "reported logprobs are of the unmodified distribution");
        assert_eq!(s.top_logprobs, vec![(0, raw[0])]);
        // Only tokens 1 and 3 allowed: greedy takes 3, sampling never leaves {1, 3}.
        let mut r = req(SamplingParams::greedy(), 0);
        r.allowed = Some(TokenMask::ready(vec![0b1010u32]));
        assert_eq!(sample(&logits, &r).unwrap().token, 3);
        for seed in 0..300 {
            let mut r = req(SamplingParams::default(), seed);
            r.allowed = Some(TokenMask::ready(vec![0b1010u32]));
            r.logit_bias = vec![(3, f32::NEG_INFINITY)];
            assert_eq!(sample(&logits, &r).unwrap().token, 1, "seed {seed}");
        }
        let mut r = req(SamplingParams::greedy(), 0);
        r.allowed = Some(TokenMask::ready(vec![1u32, 1]));
        assert!(sample(&logits, &r).is_err(), "a mask of the wrong size is an error, not a guess");
    }
}
