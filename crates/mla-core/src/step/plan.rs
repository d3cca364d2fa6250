//! `StepPlan`: everything a backend needs for one forward step, as plain data.
//!
//! The scheduler builds one per step; backends execute it. Nothing here refers to devices,
//! strings or HTTP, so both sides can be tested alone. Plans and outputs serialize, so the ranks
//! of a group spanning several nodes receive them over the network.

use crate::step::token_mask::TokenMask;
/// How a sequence draws its next token (the order of operations is in `sampling`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 selects greedy decoding.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// Keep the k most likely tokens; `None` disables.
    pub top_k: Option<usize>,
    /// Drop tokens whose probability is below `min_p` times the best one; 0 disables.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Multiplicative penalty on tokens seen in the prompt or output; 1 disables.
    pub repetition_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5
    }

    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.repetition_penalty != 1.0
    }
}

/// Which attention formulation the step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StepKind {
    /// Normal (decompressed MHA) path for every sequence: prompt chunks, possibly continuing a
    /// cached prefix. A one-token entry is allowed and is simply a chunk of length one.
    Prefill,
    /// Absorbed (MQA over the latent cache) path; every sequence feeds exactly one token.
    Decode,
    /// Both in one step, so running sequences keep decoding while a prompt is being computed:
    /// the first `prefill` sequences are prompt chunks on the normal path, the rest feed one
    /// token each on the absorbed path. Everything but attention runs over all rows at once,
    /// so the step reads the FFN weights once for both.
    Mixed { prefill: usize },
}

impl StepKind {
    /// Whether any sequence of the step runs the normal (prompt) path.
    pub fn has_prefill(self) -> bool {
        !matches!(self, StepKind::Decode)
    }
}

/// Which logits a sequence wants back (tests and scoring; serving normally asks for none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum LogitsRequest {
    #[default]
    None,
    /// Logits of the last fed token only.
    Last,
    /// Logits of every fed token, in order.
    All,
    /// Prompt logprobs: every fed row scored against the token after it (the next fed token;
    /// for the last row `after`, and `None` leaves the last row unscored) with its `top` most
    /// likely tokens (`RowScore`, in `SeqResult::scores`). The backend scores the rows where it
    /// computed them, so no logits row leaves it (at DeepSeek's 129K vocabulary a row is 0.5 MB).
    Scored { top: u32, after: Option<u32> },
}

impl LogitsRequest {
    /// Rows a sequence feeding `fed` tokens gets scored (`Scored`).
    pub fn scored_rows(&self, fed: usize) -> usize {
        match self {
            LogitsRequest::Scored { after, .. } => fed - usize::from(after.is_none()),
            _ => 0,
        }
    }
}

/// A scored row (`LogitsRequest::Scored`): the log-probability of the token after it, its rank
/// (1 + the number of tokens scored higher, as vLLM counts it), and the most likely tokens with
/// theirs, most likely first (ties: lower id first).
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct RowScore {
    pub logprob: f32,
    pub rank: u32,
    pub top: Vec<(u32, f32)>,
}

/// Token history a sampler needs for presence / frequency / repetition penalties.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PenaltyTokens {
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
}

/// Ask the backend to draw the next token from the last fed position.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SampleRequest {
    pub params: SamplingParams,
    /// Seed for this draw alone; the engine derives it from the request seed and the output
    /// index, so the same seed gives the same tokens whatever the batch looks like.
    pub seed: u64,
    /// `Some(k)`: return the chosen token's log-probability and the `k` most likely alternatives.
    pub top_logprobs: Option<usize>,
    /// Filled only when a penalty is active.
    pub penalty: Option<PenaltyTokens>,
    /// Added to the raw logits before anything else (OpenAI's `logit_bias`; `-inf` on the stop
    /// tokens while `min_tokens` is not reached). Sorted by token, each token once.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Structured output: only these tokens may be drawn. The engine fills the mask while the
    /// step's forward pass runs (`TokenMask`). Log-probabilities stay those of the model.
    #[serde(default)]
    pub allowed: Option<TokenMask>,
}

impl SampleRequest {
    /// A draw with `params` and `seed` and nothing else asked for.
    pub fn new(params: SamplingParams, seed: u64) -> Self {
        SampleRequest { params, seed, top_logprobs: None, penalty: None, logit_bias: Vec::new(), allowed: None }
    }

    /// Whether the raw logits are changed before the sampler's usual processing.
    pub fn shapes_logits(&self) -> bool {
        !self.logit_bias.is_empty() || self.allowed.is_some()
    }
}

/// Speculative decoding with the model's MTP layer, for one sequence of a step
/// (docs/speculative-decoding.md). The backend verifies the drafts it proposed last step, runs
/// the MTP layer over the rows whose next token is now known, and proposes the next drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MtpStep {
    /// How many trailing `tokens` of a decode row are drafts to verify: the row feeds the last
    /// emitted token, then the drafts, at consecutive positions.
    pub drafts_fed: usize,
    /// A prompt chunk that is not the end of what the sequence feeds: the token after it, so the
    /// MTP row of the chunk's last position has its pair. `None` where the step's own draw
    /// supplies it (or nothing does; that row then keeps stale values, which can cost
    /// acceptance but never correctness: verification decides what is emitted).
    pub next_token: Option<u32>,
    /// Drafts to propose for the next step (0: none). The block table must cover
    /// `draft - 1` positions past the step's fed tokens, where the drafting rows go.
    pub draft: usize,
}

/// A copy of one cache block into another, every layer's (the MTP layer's too), made before the
/// step writes anything: a sequence that shares a computed block with others takes its own copy
/// before writing into it (copy on write). The completions of an `n`-way request share the
/// prompt up to its last token this way, and each computes one token instead of the prompt's
/// last block (`Backend::forks_blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockFork {
    pub from: u32,
    /// A block of the sequence's own table, the one its first fed token lands in.
    pub to: u32,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SeqStep {
    pub seq_id: u64,
    /// Tokens fed this step: a prompt chunk, or the one token sampled last step.
    pub tokens: Vec<u32>,
    /// Tokens of this sequence already in the KV cache; `tokens[0]` sits at this position.
    pub context_len: usize,
    /// Physical cache blocks holding positions `0 .. context_len + tokens.len()`, in order.
    pub block_table: Vec<u32>,
    pub logits: LogitsRequest,
    pub sample: Option<SampleRequest>,
    /// Speculative decoding; `None` without it.
    #[serde(default)]
    pub mtp: Option<MtpStep>,
    /// A block to copy into this sequence's before the step (`BlockFork`); `None` almost always.
    #[serde(default)]
    pub fork: Option<BlockFork>,
}

impl SeqStep {
    /// Position one past the last fed token.
    pub fn end_pos(&self) -> usize {
        self.context_len + self.tokens.len()
    }

    /// Drafts fed to be verified (0 without speculative decoding).
    pub fn drafts_fed(&self) -> usize {
        self.mtp.map_or(0, |m| m.drafts_fed)
    }

    /// Positions the block table must cover: the fed tokens, and the rows drafting writes.
    pub fn table_positions(&self) -> usize {
        self.end_pos() + self.mtp.map_or(0, |m| m.draft.saturating_sub(1))
    }

    /// Rows of logits the backend computes for it: the sampled row, then the rows asked for (a
    /// `Last` row that is also sampled is the same row; `All` and `Scored` rows are computed
    /// apart from it).
    pub fn logit_rows(&self) -> usize {
        let sampled = usize::from(self.sample.is_some());
        sampled
            + match self.logits {
                LogitsRequest::None => 0,
                LogitsRequest::Last => 1 - sampled,
                LogitsRequest::All | LogitsRequest::Scored { .. } => self.tokens.len(),
            }
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepPlan {
    pub kind: StepKind,
    pub seqs: Vec<SeqStep>,
}

/// A plan that does not fit the backend's cache or violates the step kind.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("sequence {seq_id}: feeds no tokens")]
    EmptySequence { seq_id: u64 },
    #[error("sequence {seq_id}: a decode step feeds exactly one token per row (plus the drafts it verifies: {drafts}), found {found}")]
    DecodeNeedsOneToken { seq_id: u64, found: usize, drafts: usize },
    #[error("sequence {seq_id}: {why}")]
    Speculative { seq_id: u64, why: &'static str },
    #[error("a mixed step names {prefill} prompt chunks but holds only {seqs} sequences")]
    MixedPrefillCount { prefill: usize, seqs: usize },
    #[error(
        "sequence {seq_id}: block table has {have} blocks of {block_size} tokens, {need} positions need {need_blocks}"
    )]
    BlockTableTooShort { seq_id: u64, have: usize, block_size: usize, need: usize, need_blocks: usize },
    #[error("sequence {seq_id}: block {block} is outside the cache (0..{num_blocks})")]
    BlockOutOfRange { seq_id: u64, block: u32, num_blocks: usize },
    #[error("sequence {seq_id}: token {token} is outside the vocabulary (0..{vocab_size})")]
    TokenOutOfRange { seq_id: u64, token: u32, vocab_size: usize },
    #[error("sequence {seq_id}: position {end} exceeds the model's maximum of {max}")]
    TooLong { seq_id: u64, end: usize, max: usize },
    #[error("sequence {seq_id}: {why}")]
    Fork { seq_id: u64, why: &'static str },
    #[error("sequence {seq_id}: scored rows cannot report {top} alternatives of a {vocab_size}-token vocabulary")]
    ScoredTop { seq_id: u64, top: u32, vocab_size: usize },
}

impl StepPlan {
    /// Checks the plan against a cache of `num_blocks` blocks of `block_size` tokens, a
    /// vocabulary and a maximum length. Every backend calls this before touching memory.
    pub fn validate(
        &self,
        block_size: usize,
        num_blocks: usize,
        vocab_size: usize,
        max_len: usize,
    ) -> Result<(), PlanError> {
        if let StepKind::Mixed { prefill } = self.kind {
            if prefill > self.seqs.len() {
                return Err(PlanError::MixedPrefillCount { prefill, seqs: self.seqs.len() });
            }
        }
        let first_decode = self.num_prefill();
        for (i, s) in self.seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(PlanError::EmptySequence { seq_id: s.seq_id });
            }
            let drafts = s.drafts_fed();
            if i >= first_decode && s.tokens.len() != 1 + drafts {
                return Err(PlanError::DecodeNeedsOneToken { seq_id: s.seq_id, found: s.tokens.len(), drafts });
            }
            if let Some(m) = s.mtp {
                Self::check_speculative(s, m, i >= first_decode)?;
            }
            let need = s.table_positions();
            if need > max_len {
                return Err(PlanError::TooLong { seq_id: s.seq_id, end: need, max: max_len });
            }
            let need_blocks = need.div_ceil(block_size);
            if s.block_table.len() < need_blocks {
                return Err(PlanError::BlockTableTooShort {
                    seq_id: s.seq_id,
                    have: s.block_table.len(),
                    block_size,
                    need,
                    need_blocks,
                });
            }
            // One branch-free pass (the maximum) per table: this runs every step over every
            // block of the batch; the search for the culprit only runs when there is one.
            if s.block_table.iter().copied().max().is_some_and(|b| b as usize >= num_blocks) {
                let &b =
                    s.block_table.iter().find(|&&b| b as usize >= num_blocks).expect("the maximum is out of range");
                return Err(PlanError::BlockOutOfRange { seq_id: s.seq_id, block: b, num_blocks });
            }
            if let Some(f) = s.fork {
                Self::check_fork(s, f, block_size, num_blocks)?;
            }
            if s.tokens.iter().copied().max().is_some_and(|t| t as usize >= vocab_size) {
                let &t = s.tokens.iter().find(|&&t| t as usize >= vocab_size).expect("the maximum is out of range");
                return Err(PlanError::TokenOutOfRange { seq_id: s.seq_id, token: t, vocab_size });
            }
            if let LogitsRequest::Scored { top, after } = s.logits {
                if top as usize > vocab_size {
                    return Err(PlanError::ScoredTop { seq_id: s.seq_id, top, vocab_size });
                }
                if let Some(t) = after.filter(|&t| t as usize >= vocab_size) {
                    return Err(PlanError::TokenOutOfRange { seq_id: s.seq_id, token: t, vocab_size });
                }
            }
        }
        Ok(())
    }

    /// A fork copies another block of the cache into the one the sequence's first fed token
    /// lands in.
    fn check_fork(s: &SeqStep, f: BlockFork, block_size: usize, num_blocks: usize) -> Result<(), PlanError> {
        let why = |why| Err(PlanError::Fork { seq_id: s.seq_id, why });
        if f.from as usize >= num_blocks {
            return why("the block it forks from is outside the cache");
        }
        if s.block_table.get(s.context_len / block_size) != Some(&f.to) {
            return why("a fork's target must be the block its first fed token lands in");
        }
        if f.from == f.to {
            return why("a block cannot be forked into itself");
        }
        Ok(())
    }

    /// Whether any sequence of the plan forks a block (`BlockFork`).
    pub fn has_forks(&self) -> bool {
        self.seqs.iter().any(|s| s.fork.is_some())
    }

    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// What speculative decoding asks of a sequence must be something the backend can do
    /// exactly: drafts are verified greedily or by rejection sampling (`speculative`), each row
    /// shaped as a draw without drafts would be: a grammar's mask holds one mask per verify row
    /// (`TokenMask::pending_rows`, the grammar advanced along the drafts). Whether a backend
    /// verifies sampled drafts, and penalised or biased ones, is its own
    /// (`Backend::verifies_sampled_drafts`, `verifies_shaped_drafts`).
    fn check_speculative(s: &SeqStep, m: MtpStep, decode_row: bool) -> Result<(), PlanError> {
        let why = |why| Err(PlanError::Speculative { seq_id: s.seq_id, why });
        if m.drafts_fed > 0 && !decode_row {
            return why("drafts are verified on decode rows only");
        }
        if (m.drafts_fed > 0 || m.draft > 0) && s.sample.is_none() {
            return why("drafting and verifying need the step to sample");
        }
        if m.next_token.is_some() && (decode_row || s.sample.is_some()) {
            return why("next_token belongs to a prompt chunk that does not sample");
        }
        if m.drafts_fed > 0 && s.logits != LogitsRequest::None {
            return why("a row that verifies drafts returns no logits");
        }
        if let Some(mask) = s.sample.as_ref().and_then(|r| r.allowed.as_ref()) {
            if mask.rows() != m.drafts_fed + 1 {
                return why("a grammar's mask needs one row per verify row: the fed token and each draft");
            }
        }
        Ok(())
    }

    /// Whether a sequence drafts or verifies with penalties, `logit_bias` or a grammar's mask,
    /// which change a verify row's logits by the drafts before it; a backend verifies those only
    /// where it says so (`Backend::verifies_shaped_drafts`).
    pub fn has_shaped_drafts(&self) -> bool {
        self.seqs.iter().any(|s| {
            let drafting = s.mtp.is_some_and(|m| m.drafts_fed > 0 || m.draft > 0);
            drafting
                && s.sample
                    .as_ref()
                    .is_some_and(|r| r.penalty.is_some() || !r.logit_bias.is_empty() || r.allowed.is_some())
        })
    }

    /// Whether any sequence asks for speculative decoding (`SeqStep::mtp`).
    pub fn has_speculative(&self) -> bool {
        self.seqs.iter().any(|s| s.mtp.is_some())
    }

    /// How many of the leading sequences run the normal (prompt) path; the rest are decode rows.
    pub fn num_prefill(&self) -> usize {
        match self.kind {
            StepKind::Prefill => self.seqs.len(),
            StepKind::Decode => 0,
            StepKind::Mixed { prefill } => prefill.min(self.seqs.len()),
        }
    }

    /// The prompt chunks and the decode rows of the step, in plan order.
    pub fn split(&self) -> (&[SeqStep], &[SeqStep]) {
        self.seqs.split_at(self.num_prefill())
    }

    /// Rows of logits the step computes (`SeqStep::logit_rows`).
    pub fn logit_rows(&self) -> usize {
        self.seqs.iter().map(SeqStep::logit_rows).sum()
    }

    /// Whether a draw of this plan waits for a structured-output mask not yet computed.
    pub fn has_pending_masks(&self) -> bool {
        self.seqs.iter().any(|s| s.sample.as_ref().and_then(|r| r.allowed.as_ref()).is_some_and(|m| !m.is_filled()))
    }
}

/// Physical cache slot (block * block_size + offset) of logical position `pos`.
pub fn slot_of(block_table: &[u32], block_size: usize, pos: usize) -> usize {
    block_table[pos / block_size] as usize * block_size + pos % block_size
}

/// The token a backend drew, with log-probabilities of the unmodified model distribution.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SampledToken {
    pub token: u32,
    /// Log-probability of `token`; filled when `top_logprobs` was asked for, else 0.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, best first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// One sequence's result, in the order of `StepPlan::seqs`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SeqResult {
    pub seq_id: u64,
    /// Rows of `vocab_size` logits as asked by `LogitsRequest` (empty for `None`).
    pub logits: Vec<Vec<f32>>,
    pub sampled: Option<SampledToken>,
    /// Speculative decoding: the tokens emitted after `sampled`, in order (the drafts that
    /// stood after the first, then the target's own choice where the first one failed or all
    /// stood). `sampled` and these are what the step adds to the sequence.
    #[serde(default)]
    pub extra_tokens: Vec<SampledToken>,
    /// Speculative decoding: the drafts for the next step (`MtpStep::draft` of them).
    #[serde(default)]
    pub drafts: Vec<u32>,
    /// `LogitsRequest::Scored`: one per scored row, in order.
    #[serde(default)]
    pub scores: Vec<RowScore>,
}

#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct StepOutput {
    pub seqs: Vec<SeqResult>,
}

#[cfg(test)]
mod checks {
    use super::*;

    fn forking(fork: BlockFork) -> StepPlan {
        let seq = SeqStep {
            seq_id: 7,
            tokens: vec![1],
            context_len: 9,
            block_table: vec![5, 2, 6],
            logits: LogitsRequest::None,
            sample: None,
            mtp: None,
            fork: Some(fork),
        };
        StepPlan { kind: StepKind::Prefill, seqs: vec![seq] }
    }

    #[test]
    fn a_fork_goes_into_the_block_the_first_fed_token_lands_in_from_another_in_the_cache() {
        // Position 9 with blocks of 4 lands in the table's third block, 6.
        let check = |from, to| forking(BlockFork { from, to }).validate(4, 8, 10, 100);
        assert_eq!(check(3, 6), Ok(()));
        let refused = |why| Err(PlanError::Fork { seq_id: 7, why });
        assert_eq!(check(3, 2), refused("a fork's target must be the block its first fed token lands in"));
        assert_eq!(check(8, 6), refused("the block it forks from is outside the cache"));
        assert_eq!(check(6, 6), refused("a block cannot be forked into itself"));
        assert!(forking(BlockFork { from: 3, to: 6 }).has_forks());
    }

    #[test]
    fn scored_rows_name_a_token_in_the_vocabulary_and_no_more_alternatives_than_it_has() {
        let scored = |top, after| {
            let mut p = forking(BlockFork { from: 3, to: 6 });
            p.seqs[0].fork = None;
            p.seqs[0].tokens = vec![1, 2, 3];
            p.seqs[0].context_len = 0;
            p.seqs[0].logits = LogitsRequest::Scored { top, after };
            p.validate(4, 8, 10, 100)
        };
        assert_eq!(scored(10, Some(9)), Ok(()));
        assert_eq!(scored(3, None), Ok(()));
        assert_eq!(scored(3, Some(10)), Err(PlanError::TokenOutOfRange { seq_id: 7, token: 10, vocab_size: 10 }));
        assert_eq!(scored(11, None), Err(PlanError::ScoredTop { seq_id: 7, top: 11, vocab_size: 10 }));
        assert_eq!(LogitsRequest::Scored { top: 1, after: None }.scored_rows(3), 2);
        assert_eq!(LogitsRequest::Scored { top: 1, after: Some(0) }.scored_rows(3), 3);
        assert_eq!(LogitsRequest::All.scored_rows(3), 0);
    }

    #[test]
    fn shaped_drafts_are_told_apart_and_a_grammar_masks_every_verify_row() {
        let row = |penalty: bool, bias: bool, draft: usize| {
            let mut req = SampleRequest::new(SamplingParams { repetition_penalty: 1.2, ..Default::default() }, 1);
            if penalty {
                req.penalty = Some(PenaltyTokens { prompt: vec![1], output: vec![] });
            }
            if bias {
                req.logit_bias = vec![(3, 1.0)];
            }
            let mtp = Some(MtpStep { drafts_fed: 0, next_token: None, draft });
            let seq = SeqStep {
                seq_id: 1,
                tokens: vec![2],
                context_len: 0,
                block_table: vec![0],
                logits: LogitsRequest::None,
                sample: Some(req),
                mtp,
                fork: None,
            };
            StepPlan { kind: StepKind::Prefill, seqs: vec![seq] }
        };
        assert!(row(true, false, 1).has_shaped_drafts() && row(false, true, 2).has_shaped_drafts());
        assert!(!row(true, true, 0).has_shaped_drafts(), "a row that drafts nothing is not shaped drafting");
        assert!(!row(false, false, 1).has_shaped_drafts());
        assert_eq!(row(true, true, 1).validate(4, 8, 10, 100), Ok(()));
        // A drafting row samples one mask; a row verifying two drafts needs three.
        let masked = |rows: usize, drafts_fed: usize| {
            let mut p = row(false, false, 1);
            let s = &mut p.seqs[0];
            s.tokens = vec![2; 1 + drafts_fed];
            s.mtp.as_mut().unwrap().drafts_fed = drafts_fed;
            p.kind = StepKind::Decode;
            let (mask, writer) = crate::step::token_mask::TokenMask::pending_rows(rows);
            writer.fill(vec![u32::MAX; rows]);
            s.sample.as_mut().unwrap().allowed = Some(mask);
            assert!(p.has_shaped_drafts(), "a grammar's rows are shaped by the drafts before them");
            p.validate(4, 8, 10, 100)
        };
        assert_eq!(masked(1, 0), Ok(()));
        assert_eq!(masked(3, 2), Ok(()));
        assert!(matches!(masked(1, 2), Err(PlanError::Speculative { .. })));
        assert!(matches!(masked(3, 0), Err(PlanError::Speculative { .. })));
    }
}
