//! The CPU reference's verdict of a sequence's verify rows and the draw of its drafts, on the
//! host, from the rows' logits (the rule and seeds of `mla_core::speculative`). The CUDA backend
//! applies the same rule on the device (kernels/speculative.cu); both pass the same statistical
//! check (`mla_core::speculative::lossless_check`).

use mla_core::rng::SplitMix64;
use mla_core::sampling::{argmax, distribution, report, sample, shaped_logits, Distribution};
use mla_core::speculative::{
    draft_seed, greedy_emitted, point_mass, row_request, row_seed, verify_sampled, Verdict, Verified,
};
use mla_core::step::plan::{SampleRequest, SeqStep, StepPlan};
use mla_core::step::token_mask::MaskError;
use std::collections::HashMap;

/// A sequence's sampled drafts and the distributions they were drawn from, kept by the rank from
/// the step that drew them to the step that verifies them.
#[derive(Debug, Clone, Default)]
pub struct Drawn {
    pub drafts: Vec<u32>,
    pub q: Vec<Distribution>,
}

/// Verifies one sequence's rows; `rows[j]` is the target's row `j` (`None` where no logits were
/// computed; every row from the last emitted token on has them). `drawn`: what the rank kept of
/// the sequence's last drafts. Their distributions are used where the fed drafts are the ones
/// drawn from them; any other draft is verified against its point mass (`point_mass`), which is
/// exact for a draft chosen any way, only accepted less.
pub fn verify(s: &SeqStep, rows: &[Option<Vec<f32>>], drawn: Option<&Drawn>) -> Result<Verified, MaskError> {
    let Some(req) = &s.sample else { return Ok(Verified::default()) };
    let fed = s.drafts_fed();
    let first = rows.len() - 1 - fed;
    let row = |j: usize| rows[first + j].as_deref().expect("verified rows have logits");
    let drafts = &s.tokens[s.tokens.len() - fed..];
    let q = drawn.filter(|k| k.q.len() >= fed && k.drafts.get(..fed) == Some(drafts)).map(|k| &k.q[..fed]);
    if req.params.is_greedy() || fed == 0 {
        let choices = (0..=fed).map(|j| sample(row(j), &row_request(req, drafts, j))).collect::<Result<Vec<_>, _>>()?;
        let tokens: Vec<u32> = choices.iter().map(|c| c.token).collect();
        let emitted = greedy_emitted(&tokens, drafts);
        return Ok(Verified { choices, emitted });
    }
    // Rejection sampling, row by row, against each row's distribution as a draw without drafts
    // would have it: its logits shaped by the bias and by penalties that count the drafts before
    // it and by the grammar's mask after them (`row_request`).
    let mut choices = Vec::with_capacity(fed + 1);
    for (j, &d) in drafts.iter().enumerate() {
        let p = distribution(&shaped_logits(row(j), &row_request(req, drafts, j))?, &req.params);
        let own = q.map_or_else(|| point_mass(d), |q| q[j].clone());
        let token = match verify_sampled(&p, &own, d, row_seed(req.seed, j)) {
            Verdict::Accept => d,
            Verdict::Replace(t) => t,
        };
        choices.push(report(row(j), req, token));
        if token != d {
            // Rows after a replaced draft emit nothing; the MTP pass still pairs each with a
            // token (any will do: those entries are rewritten before anything reads them).
            let emitted = choices.len();
            choices.resize(fed + 1, choices[emitted - 1].clone());
            return Ok(Verified { choices, emitted });
        }
    }
    let bonus = SampleRequest { seed: row_seed(req.seed, fed), ..row_request(req, drafts, fed).into_owned() };
    choices.push(sample(row(fed), &bonus)?);
    Ok(Verified { choices, emitted: fed + 1 })
}

/// The draft a drafting row proposes from the MTP layer's `logits`: the argmax for a greedy
/// draw, else a draw from `q` (the request's parameters on the layer's logits) with the draft's
/// own seed, `q` returned to be kept until the drafts are verified. The request's `logit_bias`
/// shapes the layer's logits as it shapes the target's, so a banned token is not proposed;
/// penalties do not (their history at this row is not at hand, and any `q` is exact: it only
/// decides how often drafts stand).
pub fn propose(logits: &[f32], req: &SampleRequest, j: usize) -> (u32, Option<Distribution>) {
    let biased;
    let logits = if req.logit_bias.is_empty() {
        logits
    } else {
        let mut l = logits.to_vec();
        mla_core::sampling::apply_shaping(&mut l, &req.logit_bias, None);
        biased = l;
        &biased
    };
    if req.params.is_greedy() {
        return (argmax(logits), None);
    }
    let q = distribution(logits, &req.params);
    let d = q.pick(SplitMix64::new(draft_seed(req.seed, j)).next_f64());
    (d, Some(q))
}

/// What a step's MTP passes propose: per sequence of the plan, its drafts for the next step and,
/// for a sampled draw, the distribution each was drawn from.
#[derive(Debug, Default)]
pub struct Proposals {
    pub drafts: Vec<Vec<u32>>,
    pub q: Vec<Vec<Distribution>>,
}

impl Proposals {
    /// Nothing proposed yet for the `seqs` sequences of a plan.
    pub fn new(seqs: usize) -> Self {
        Proposals { drafts: vec![Vec::new(); seqs], q: vec![Vec::new(); seqs] }
    }

    /// Sequence `seq`'s next draft, as `propose` gives it.
    pub fn push(&mut self, seq: usize, (d, q): (u32, Option<Distribution>)) {
        self.drafts[seq].push(d);
        self.q[seq].extend(q);
    }

    /// The drafts per sequence of `plan`, and what the rank keeps of them until the next step
    /// verifies them: the sampled ones with their distributions, by sequence id.
    pub fn keep(self, plan: &StepPlan) -> (Vec<Vec<u32>>, HashMap<u64, Drawn>) {
        let kept = plan
            .seqs
            .iter()
            .zip(self.drafts.iter().zip(self.q))
            .filter(|(_, (_, q))| !q.is_empty())
            .map(|(s, (d, q))| (s.seq_id, Drawn { drafts: d.clone(), q }))
            .collect();
        (self.drafts, kept)
    }
}
