//! The largest step a backend runs, as one plan for every layout.
//!
//! A step is bounded in several places at once: the tokens and sequences one attention rank
//! feeds, the logit rows it returns, and, under DP attention, the rows of every rank that the
//! FFN layers see together once they are gathered. `StepLimits` holds all of them, derived once
//! from the flags and the layout (`StepLimits::derive`). From it:
//! - the engine's schedulers build every step within it (`mla-engine`);
//! - the backends size their activation buffers and scratch from it (the CUDA workspace, the
//!   FP8 projections' scratch, the gathered FFN buffers), and the CUDA memory planner may give
//!   it a smaller token budget (`halved`) to leave room for the KV cache;
//! - every backend, the CPU reference included, checks each step against it before any rank
//!   starts (`check`), so a step nothing was sized for is a refused step, never a failure deep
//!   inside one rank's kernels while the others wait in a collective.

use crate::step::plan::StepPlan;

/// What the flags ask of one step (`--max-num-batched-tokens`, `--max-num-seqs`), before the
/// layout is taken into account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepBudget {
    /// Tokens one attention rank's step may feed: a prefill chunk's size.
    pub max_num_batched_tokens: usize,
    /// Sequences one attention rank's step may hold: the decode batch.
    pub max_num_seqs: usize,
    /// Logit rows a step may return beyond one per sampled sequence (prompt logprobs, scoring).
    pub max_extra_logit_rows: usize,
}

/// Logit rows a step may return beyond its sampled ones unless told otherwise: two chunks of
/// prompt logprobs (`mla-engine`'s `LOGITS_CHUNK` is 256).
pub const DEFAULT_EXTRA_LOGIT_ROWS: usize = 512;

/// The smallest token budget the memory planner shrinks a step to (`halved`): below it a
/// prefill chunk costs mostly per-step overhead.
pub const MIN_SHRUNK_TOKENS: usize = 256;

/// The bounds every step of a backend stays within. Equal on every rank of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StepLimits {
    /// Tokens one attention rank's plan may feed.
    pub rank_tokens: usize,
    /// Sequences one attention rank's plan may hold (never above `rank_tokens`: a decode step
    /// feeds one token per sequence).
    pub rank_seqs: usize,
    /// Logit rows one attention rank's plan may return, its sampled rows included.
    pub rank_logit_rows: usize,
    /// Attention ranks whose rows the FFN layers run over together: the group's size under DP
    /// attention (every rank's rows are gathered), otherwise 1.
    pub gathered_ranks: usize,
}

/// A step outside the limits: which one, and the numbers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LimitError(pub String);

impl StepLimits {
    /// The limits of `budget` for a backend whose FFN gathers `gathered_ranks` attention ranks'
    /// rows (1 except under DP attention). Each rank keeps the whole token budget, as each of
    /// vLLM's DP engines does: the gathered FFN step holds up to `gathered_ranks` times as many
    /// rows, and its buffers are sized for that (the CUDA memory planner halves the budget when
    /// that leaves too little room for the KV cache). Also returns what was adjusted, for the log.
    pub fn derive(budget: StepBudget, gathered_ranks: usize) -> Result<(StepLimits, Vec<String>), LimitError> {
        let StepBudget { max_num_batched_tokens: tokens, max_num_seqs: seqs, max_extra_logit_rows: extra } = budget;
        if tokens == 0 || seqs == 0 || gathered_ranks == 0 {
            return Err(LimitError(format!("a step needs at least one token, sequence and rank: {budget:?}")));
        }
        let mut notes = Vec::new();
        let rank_seqs = if seqs > tokens {
            notes.push(format!(
                "--max-num-seqs {seqs} is above --max-num-batched-tokens {tokens}: a decode step feeds one token per \
                 sequence, so at most {tokens} sequences run together"
            ));
            tokens
        } else {
            seqs
        };
        let limits = StepLimits { rank_tokens: tokens, rank_seqs, rank_logit_rows: rank_seqs + extra, gathered_ranks };
        Ok((limits, notes))
    }

    /// Limits no step reaches (test backends that size nothing).
    pub fn unlimited() -> StepLimits {
        let big = 1 << 32;
        StepLimits { rank_tokens: big, rank_seqs: big, rank_logit_rows: 2 * big, gathered_ranks: 1 << 16 }
    }

    /// Rows the FFN layers (and every projection) see in the largest step.
    pub fn ffn_rows(&self) -> usize {
        self.gathered_ranks * self.rank_tokens
    }

    /// Logit rows beyond the sampled ones that one rank's step may return.
    pub fn extra_logit_rows(&self) -> usize {
        self.rank_logit_rows - self.rank_seqs
    }

    /// The same limits with half the token budget (and the sequences cut to it), for the memory
    /// planner; `None` below `MIN_SHRUNK_TOKENS` or when already at it.
    pub fn halved(&self) -> Option<StepLimits> {
        let tokens = (self.rank_tokens / 2).max(MIN_SHRUNK_TOKENS);
        if tokens >= self.rank_tokens {
            return None;
        }
        let seqs = self.rank_seqs.min(tokens);
        Some(StepLimits {
            rank_tokens: tokens,
            rank_seqs: seqs,
            rank_logit_rows: seqs + self.extra_logit_rows(),
            gathered_ranks: self.gathered_ranks,
        })
    }

    /// Checks one step, `plans[r]` for attention rank r, before any rank starts it.
    pub fn check(&self, plans: &[StepPlan]) -> Result<(), LimitError> {
        for (r, plan) in plans.iter().enumerate() {
            let who = if plans.len() > 1 { format!("rank {r}'s step") } else { "the step".to_string() };
            let (tokens, seqs, logits) = (plan.num_tokens(), plan.seqs.len(), plan.logit_rows());
            if tokens > self.rank_tokens {
                return Err(LimitError(format!(
                    "{who} feeds {tokens} tokens; steps hold at most {} (max_num_batched_tokens)",
                    self.rank_tokens
                )));
            }
            if seqs > self.rank_seqs {
                return Err(LimitError(format!(
                    "{who} has {seqs} sequences; steps hold at most {} (max_num_seqs)",
                    self.rank_seqs
                )));
            }
            if logits > self.rank_logit_rows {
                return Err(LimitError(format!(
                    "{who} returns {logits} rows of logits; steps return at most {}",
                    self.rank_logit_rows
                )));
            }
        }
        let gathered: usize = plans.iter().map(StepPlan::num_tokens).sum();
        if plans.len() > self.gathered_ranks || gathered > self.ffn_rows() {
            return Err(LimitError(format!(
                "{} plans feed {gathered} tokens together; the FFN gathers at most {} ranks and {} rows",
                plans.len(),
                self.gathered_ranks,
                self.ffn_rows()
            )));
        }
        Ok(())
    }

    /// One line for the startup log.
    pub fn describe(&self) -> String {
        let gathered = if self.gathered_ranks > 1 {
            format!(", the FFN over {} gathered rows of {} ranks", self.ffn_rows(), self.gathered_ranks)
        } else {
            String::new()
        };
        format!(
            "steps of at most {} tokens and {} sequences per attention rank ({} logit rows){gathered}",
            self.rank_tokens, self.rank_seqs, self.rank_logit_rows
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::plan::{LogitsRequest, SampleRequest, SeqStep, StepKind};
    use crate::SamplingParams;

    fn budget(tokens: usize, seqs: usize) -> StepBudget {
        StepBudget { max_num_batched_tokens: tokens, max_num_seqs: seqs, max_extra_logit_rows: 8 }
    }

    fn plan(seqs: usize, tokens_each: usize, logits: LogitsRequest) -> StepPlan {
        let seq = |i: usize| SeqStep {
            fork: None,
            seq_id: i as u64,
            tokens: vec![1; tokens_each],
            context_len: 0,
            block_table: vec![0],
            logits,
            sample: Some(SampleRequest::new(SamplingParams::greedy(), 0)),
            mtp: None,
        };
        StepPlan { kind: StepKind::Prefill, seqs: (0..seqs).map(seq).collect() }
    }

    #[test]
    fn dp_attention_sizes_the_ffn_for_every_rank_and_checks_the_sum() {
        let (s, notes) = StepLimits::derive(budget(16, 4), 4).unwrap();
        assert!(notes.is_empty());
        assert_eq!((s.rank_tokens, s.rank_seqs, s.rank_logit_rows, s.ffn_rows()), (16, 4, 12, 64));
        // Every rank prefilling a full chunk at once: the largest gathered step.
        let full = vec![plan(1, 16, LogitsRequest::None); 4];
        s.check(&full).unwrap();
        // One token over on one rank is refused, naming the rank and the flag.
        let mut over = full.clone();
        over[2] = plan(1, 17, LogitsRequest::None);
        let e = s.check(&over).unwrap_err().to_string();
        assert!(e.contains("rank 2") && e.contains("max_num_batched_tokens"), "{e}");
        // More plans than the FFN gathers.
        let e = s.check(&vec![plan(1, 1, LogitsRequest::None); 5]).unwrap_err().to_string();
        assert!(e.contains("gathers at most 4 ranks"), "{e}");
    }

    #[test]
    fn sequences_and_logit_rows_are_bounded() {
        let (s, _) = StepLimits::derive(budget(64, 4), 1).unwrap();
        assert!(s.check(&[plan(5, 1, LogitsRequest::None)]).unwrap_err().to_string().contains("max_num_seqs"));
        // Sampled rows plus every prompt row: 2 + 8 and 4 + 8 fit the 4 + 8 rows; 3 + 12 does not.
        s.check(&[plan(2, 4, LogitsRequest::All)]).unwrap();
        s.check(&[plan(4, 2, LogitsRequest::All)]).unwrap();
        let e = s.check(&[plan(3, 4, LogitsRequest::All)]).unwrap_err().to_string();
        assert!(e.contains("returns 15 rows of logits") && e.contains("at most 12"), "{e}");
    }

    #[test]
    fn more_sequences_than_tokens_are_cut_with_a_note() {
        let (s, notes) = StepLimits::derive(budget(16, 256), 1).unwrap();
        assert_eq!((s.rank_tokens, s.rank_seqs), (16, 16));
        assert_eq!(notes.len(), 1);
        assert!(notes[0].contains("--max-num-seqs 256"), "{}", notes[0]);
        assert!(StepLimits::derive(budget(0, 1), 1).is_err());
    }

    #[test]
    fn halving_stops_at_the_floor_and_keeps_sequences_within_tokens() {
        let (s, _) = StepLimits::derive(budget(2048, 256), 4).unwrap();
        let h = s.halved().unwrap();
        assert_eq!((h.rank_tokens, h.rank_seqs, h.ffn_rows(), h.extra_logit_rows()), (1024, 256, 4096, 8));
        let floor = h.halved().unwrap().halved().unwrap();
        assert_eq!((floor.rank_tokens, floor.rank_seqs, floor.rank_logit_rows), (MIN_SHRUNK_TOKENS, 256, 264));
        assert_eq!(floor.halved(), None);
        let (small, _) = StepLimits::derive(budget(300, 300), 1).unwrap();
        let h = small.halved().unwrap();
        assert_eq!((h.rank_tokens, h.rank_seqs), (256, 256));
        assert_eq!(StepLimits::derive(budget(64, 4), 1).unwrap().0.halved(), None);
    }
}
