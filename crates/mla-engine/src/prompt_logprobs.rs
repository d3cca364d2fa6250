//! Prompt logprobs (vLLM's `prompt_logprobs`, and `echo` with `logprobs` on completions): the
//! log-probability of every prompt token given the tokens before it, gathered from the logits
//! of the prompt chunks as they are computed.
//!
//! The logits of position `p` score prompt token `p + 1`, so positions `0 .. prompt_len - 1`
//! are needed (the last prompt position's logits draw the first output token instead). The
//! first sequence of the request in a plan that computes one of them still missing claims it and
//! asks for every fed position's scores (`LogitsRequest::Scored`: the backend scores the rows
//! where it computed them, so no logits row leaves it); the others of that plan feeding the same
//! positions ask for none, so a position is scored once per prompt, not `n` times. Claims last
//! until the plan is applied. Every needed position is computed by the request itself
//! because it does not take blocks from the prefix cache until its prompt logprobs are complete
//! (see `Scheduler`), as in vLLM.

use crate::api::PromptTokenLogprob;
use mla_core::step::plan::RowScore;
use std::cell::Cell;

/// Most prompt positions one step scores, per sequence: each is a logits row of `vocab_size`
/// floats (0.5 MB for DeepSeek's 129K vocabulary) that the backend holds until it is scored.
/// Prompt chunks of such requests are cut to this length instead.
pub const LOGITS_CHUNK: usize = 256;

/// What a request has gathered so far.
#[derive(Debug)]
pub struct PromptLogprobs {
    /// Alternatives per position.
    k: usize,
    /// Entry `p` scores prompt token `p + 1`.
    rows: Vec<Option<PromptTokenLogprob>>,
    missing: usize,
    sent: bool,
    /// Positions below this are asked for by a sequence of the plan being built (`claim`).
    claimed: Cell<usize>,
}

impl PromptLogprobs {
    pub fn new(prompt_len: usize, k: usize) -> Self {
        let needed = prompt_len.saturating_sub(1);
        PromptLogprobs { k, rows: vec![None; needed], missing: needed, sent: false, claimed: Cell::new(0) }
    }

    /// Whether feeding positions `from .. to` computes one still missing.
    pub fn wants(&self, from: usize, to: usize) -> bool {
        self.missing > 0 && (from..to.min(self.rows.len())).any(|p| self.rows[p].is_none())
    }

    /// Whether feeding positions `from .. to` in the plan being built computes a missing one
    /// that no sequence before it in this plan claimed.
    pub fn unclaimed(&self, from: usize, to: usize) -> bool {
        self.wants(from.max(self.claimed.get()), to)
    }

    /// Whether the sequence feeding positions `from .. to` in the plan being built should ask
    /// for their logits (`unclaimed`). Then those positions are claimed, until the plan is
    /// applied (`record`).
    pub fn claim(&self, from: usize, to: usize) -> bool {
        if !self.unclaimed(from, to) {
            return false;
        }
        self.claimed.set(self.claimed.get().max(to));
        true
    }

    /// Alternatives per position (`LogitsRequest::Scored::top`).
    pub fn top(&self) -> u32 {
        self.k as u32
    }

    /// Until complete, cached prefix blocks must not stand in for computing the prompt.
    pub fn complete(&self) -> bool {
        self.missing == 0
    }

    /// Records the scores of positions `first ..` (one per scored fed token). The plan that
    /// claimed positions is being applied: the next one claims afresh.
    pub fn record(&mut self, prompt: &[u32], first: usize, scores: &[RowScore]) {
        self.claimed.set(0);
        for (i, s) in scores.iter().enumerate() {
            let p = first + i;
            if p < self.rows.len() && self.rows[p].is_none() {
                let token = prompt[p + 1];
                self.rows[p] = Some(PromptTokenLogprob { token, logprob: s.logprob, rank: s.rank, top: s.top.clone() });
                self.missing -= 1;
            }
        }
    }

    /// The entries, once, when every position has been recorded.
    pub fn take_complete(&mut self) -> Option<Vec<PromptTokenLogprob>> {
        if self.sent || self.missing > 0 {
            return None;
        }
        self.sent = true;
        Some(std::mem::take(&mut self.rows).into_iter().map(|r| r.expect("complete")).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mla_core::sampling::score;

    /// What a backend scores for rows of logits at positions `first ..` (`LogitsRequest::Scored`).
    fn scored(prompt: &[u32], first: usize, rows: &[Vec<f32>], k: usize) -> Vec<RowScore> {
        rows.iter().enumerate().map(|(i, r)| score(r, prompt.get(first + i + 1).copied().unwrap_or(0), k)).collect()
    }

    #[test]
    fn positions_fill_once_and_complete_together() {
        let prompt = [5, 1, 2, 0];
        let mut p = PromptLogprobs::new(prompt.len(), 1);
        assert!(p.wants(0, 2) && !p.complete());
        // Positions 0 and 1 score tokens 1 and 2.
        p.record(
            &prompt,
            0,
            &scored(&prompt, 0, &[vec![0.0, 3.0, 1.0, 0.0, 0.0, 0.0], vec![0.0, 0.0, 0.0, 5.0, 0.0, 0.0]], 1),
        );
        assert!(!p.wants(0, 2) && p.wants(0, 4) && p.take_complete().is_none());
        // The last prompt position's row (3) is not needed; a second answer for 1 is ignored.
        p.record(&prompt, 1, &scored(&prompt, 1, &[vec![9.0; 6], vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0], vec![0.0; 6]], 1));
        let rows = p.take_complete().unwrap();
        assert_eq!(rows.iter().map(|r| r.token).collect::<Vec<_>>(), vec![1, 2, 0]);
        assert_eq!((rows[0].rank, rows[0].top[0].0), (1, 1));
        assert_eq!((rows[1].rank, rows[1].top[0].0), (2, 3));
        assert_eq!(rows[2].rank, 1);
        assert!(p.take_complete().is_none(), "sent once");
    }

    #[test]
    fn the_first_sequence_in_a_plan_claims_the_missing_positions() {
        let prompt = [5, 1, 2, 0, 4];
        let mut p = PromptLogprobs::new(prompt.len(), 1);
        // The shared prefix feeds 0..2, two completions each feed 2..5: only the first asks.
        assert!(p.claim(0, 2));
        assert!(p.claim(2, 5));
        assert!(!p.claim(2, 5), "claimed by the first completion");
        // The plan is applied: what the first completion computed is recorded, nothing is
        // claimed any more.
        p.record(&prompt, 0, &scored(&prompt, 0, &[vec![0.0; 6], vec![0.0; 6]], 1));
        assert!(p.claim(2, 5), "a claim lasts for its plan only");
        p.record(&prompt, 2, &scored(&prompt, 2, &[vec![0.0; 6], vec![0.0; 6], vec![0.0; 6]], 1));
        assert!(p.complete() && !p.claim(2, 5));
    }

    #[test]
    fn one_token_prompts_are_complete_at_once() {
        let mut p = PromptLogprobs::new(1, 3);
        assert!(p.complete() && !p.wants(0, 1));
        assert_eq!(p.take_complete(), Some(vec![]));
    }
}
