//! Prompt logprobs (vLLM's `prompt_logprobs`, and `echo` with `logprobs` on completions): the
//! log-probability of every prompt token given the tokens before it, gathered from the logits
//! of the prompt chunks as they are computed.
//!
//! The logits of position `p` score prompt token `p + 1`, so positions `0 .. prompt_len - 1`
//! are needed (the last prompt position's logits draw the first output token instead). The
//! first sequence of the request in a plan that computes one of them still missing claims it and
//! asks for every fed position's logits (`LogitsRequest::All`); the others of that plan feeding
//! the same positions (the `n` completions each compute the prompt's last block) ask for none,
//! so a position's logits row is computed and moved once per prompt, not `n` times (at DeepSeek's
//! 129K vocabulary, n = 128 completions' last blocks of 64 positions were 4 GB of rows). Claims
//! last until the plan is applied. Every needed position is computed by the request itself
//! because it does not take blocks from the prefix cache until its prompt logprobs are complete
//! (see `Scheduler`), as in vLLM.

use crate::api::PromptTokenLogprob;
use mla_core::sampling::top_k_entries;
use std::cell::Cell;

/// Most prompt positions one step asks all logits for, per sequence: a row is `vocab_size`
/// floats (0.5 MB for DeepSeek's 129K vocabulary), so a whole 8K-token chunk would move 4 GB
/// to the host. Prompt chunks of such requests are cut to this length instead.
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

    /// Until complete, cached prefix blocks must not stand in for computing the prompt.
    pub fn complete(&self) -> bool {
        self.missing == 0
    }

    /// Records the logits rows of positions `first ..` (one row per fed token). The plan that
    /// claimed positions is being applied: the next one claims afresh.
    pub fn record(&mut self, prompt: &[u32], first: usize, rows: &[Vec<f32>]) {
        self.claimed.set(0);
        for (i, logits) in rows.iter().enumerate() {
            let p = first + i;
            if p < self.rows.len() && self.rows[p].is_none() {
                self.rows[p] = Some(score(logits, prompt[p + 1], self.k));
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

/// `token`'s log-probability under `logits`, its rank (1 + the number of tokens scored higher,
/// as vLLM counts it) and the `k` most likely tokens. This runs on the engine thread for every
/// prompt position, so it makes one pass for the normaliser (as `log_softmax` computes it, in
/// f64) and one for the rank, and normalises only the values it returns.
pub fn score(logits: &[f32], token: u32, k: usize) -> PromptTokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    let logprob = |x: f32| (x as f64 - lse) as f32;
    let own = logits[token as usize];
    let rank = 1 + logits.iter().filter(|&&x| x > own).count() as u32;
    let top = top_k_entries(logits, k).into_iter().map(|(id, x)| (id, logprob(x))).collect();
    PromptTokenLogprob { token, logprob: logprob(own), rank, top }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_fill_once_and_complete_together() {
        let prompt = [5, 1, 2, 0];
        let mut p = PromptLogprobs::new(prompt.len(), 1);
        assert!(p.wants(0, 2) && !p.complete());
        // Positions 0 and 1 score tokens 1 and 2.
        p.record(&prompt, 0, &[vec![0.0, 3.0, 1.0, 0.0, 0.0, 0.0], vec![0.0, 0.0, 0.0, 5.0, 0.0, 0.0]]);
        assert!(!p.wants(0, 2) && p.wants(0, 4) && p.take_complete().is_none());
        // The last prompt position's row (3) is not needed; a second answer for 1 is ignored.
        p.record(&prompt, 1, &[vec![9.0; 6], vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0], vec![0.0; 6]]);
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
        p.record(&prompt, 0, &[vec![0.0; 6], vec![0.0; 6]]);
        assert!(p.claim(2, 5), "a claim lasts for its plan only");
        p.record(&prompt, 2, &[vec![0.0; 6], vec![0.0; 6], vec![0.0; 6]]);
        assert!(p.complete() && !p.claim(2, 5));
    }

    #[test]
    fn one_token_prompts_are_complete_at_once() {
        let mut p = PromptLogprobs::new(1, 3);
        assert!(p.complete() && !p.wants(0, 1));
        assert_eq!(p.take_complete(), Some(vec![]));
    }

    #[test]
    fn score_matches_log_softmax() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1013) as f32 / 97.0).collect();
        let lp = mla_core::sampling::log_softmax(&logits);
        let s = score(&logits, 5, 4);
        assert_eq!(s.logprob, lp[5]);
        assert_eq!(s.top, top_k_entries(&lp, 4));
        let s = score(&[1.0, 2.0, 3.0], 0, 2);
        let z = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((s.logprob as f64 - (1.0 - z)).abs() < 1e-6);
        assert_eq!(s.rank, 3);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
    }
}
