//! Prompt logprobs (vLLM's `prompt_logprobs`, and `echo` with `logprobs` on completions): the
//! log-probability of every prompt token given the tokens before it, gathered from the logits
//! of the prompt chunks as they are computed.
//!
//! The logits of position `p` score prompt token `p + 1`, so positions `0 .. prompt_len - 1`
//! are needed (the last prompt position's logits draw the first output token instead). Any
//! sequence of the request that computes one of them still missing asks for every fed
//! position's logits (`LogitsRequest::All`); the first answer for a position is kept (all of the
//! request's sequences feed the same prompt, so any answer is the same). Every needed position
//! is computed by the request itself because it does not take blocks from the prefix cache
//! until its prompt logprobs are complete (see `Scheduler`), as in vLLM.

use crate::api::PromptTokenLogprob;
use mla_core::sampling::{log_softmax, top_k_entries};

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
}

impl PromptLogprobs {
    pub fn new(prompt_len: usize, k: usize) -> Self {
        let needed = prompt_len.saturating_sub(1);
        PromptLogprobs { k, rows: vec![None; needed], missing: needed, sent: false }
    }

    /// Whether feeding positions `from .. to` computes one still missing.
    pub fn wants(&self, from: usize, to: usize) -> bool {
        self.missing > 0 && (from..to.min(self.rows.len())).any(|p| self.rows[p].is_none())
    }

    /// Until complete, cached prefix blocks must not stand in for computing the prompt.
    pub fn complete(&self) -> bool {
        self.missing == 0
    }

    /// Records the logits rows of positions `first ..` (one row per fed token).
    pub fn record(&mut self, prompt: &[u32], first: usize, rows: &[Vec<f32>]) {
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
/// as vLLM counts it) and the `k` most likely tokens.
pub fn score(logits: &[f32], token: u32, k: usize) -> PromptTokenLogprob {
    let lp = log_softmax(logits);
    let logprob = lp[token as usize];
    let rank = 1 + lp.iter().filter(|&&x| x > logprob).count() as u32;
    PromptTokenLogprob { token, logprob, rank, top: top_k_entries(&lp, k) }
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
    fn one_token_prompts_are_complete_at_once() {
        let mut p = PromptLogprobs::new(1, 3);
        assert!(p.complete() && !p.wants(0, 1));
        assert_eq!(p.take_complete(), Some(vec![]));
    }

    #[test]
    fn score_matches_log_softmax() {
        let s = score(&[1.0, 2.0, 3.0], 0, 2);
        let z = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((s.logprob as f64 - (1.0 - z)).abs() < 1e-6);
        assert_eq!(s.rank, 3);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
    }
}
