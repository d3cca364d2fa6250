//! Per-request generation state the scheduler keeps: the request's parameters, its optional
//! shared prompt prefix and one `Seq` per completion.

use crate::api::{FinishReason, GenerateRequest, TokenConstraint};
use crate::block_manager::BlockTable;
use crate::prefix_hash::BlockHash;
use crate::prompt_logprobs::PromptLogprobs;
use mla_core::SplitMix64;

/// Which sequence of a request: the shared prompt prefix (`n > 1` only) or completion `i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Slot {
    Prefix,
    Completion(usize),
}

/// Identifies one sequence across the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqKey {
    pub request: u64,
    pub slot: Slot,
}

/// Completions per request are capped so a sequence id fits `request << 16 | slot`.
pub const MAX_COMPLETIONS: usize = (1 << 16) - 2;

impl SeqKey {
    /// The backend-visible id: stable across preemption, unique across the engine.
    pub fn seq_id(&self) -> u64 {
        let slot = match self.slot {
            Slot::Prefix => 0,
            Slot::Completion(i) => i as u64 + 1,
        };
        (self.request << 16) | slot
    }

    pub fn from_seq_id(id: u64) -> SeqKey {
        let slot = match id & 0xFFFF {
            0 => Slot::Prefix,
            s => Slot::Completion(s as usize - 1),
        };
        SeqKey { request: id >> 16, slot }
    }
}

/// Seed of draw `output_index` of completion `completion`. It depends on nothing else, so the
/// tokens a seeded request gets do not depend on batching, step kinds or preemption.
pub fn draw_seed(request_seed: u64, completion: usize, output_index: usize) -> u64 {
    let per_completion =
        SplitMix64::new(request_seed ^ (completion as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)).next_u64();
    SplitMix64::new(per_completion ^ (output_index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64()
}

/// Where a sequence stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqState {
    /// Not in the cache: waiting to be admitted (new, or preempted and to be recomputed).
    Waiting,
    /// Holds blocks and is being prefilled or decoded.
    Running,
    Finished(FinishReason),
}

/// One token stream through the cache.
#[derive(Debug)]
pub struct Seq {
    /// Everything this sequence feeds: for a completion the prompt and its outputs so far, for a
    /// prefix the shared part of the prompt.
    pub tokens: Vec<u32>,
    /// Tokens whose latent KV is in the cache (always a prefix of `tokens`).
    pub computed: usize,
    pub table: BlockTable,
    pub state: SeqState,
    /// Prefix caching: hashes of the leading full blocks of `tokens` worked out so far, and how
    /// many leading blocks of `table` have been offered to the cache.
    pub hashes: Vec<BlockHash>,
    pub registered: usize,
    /// Speculative decoding: the tokens the MTP layer drafted after the last one, to be
    /// verified by the next decode step (empty without it).
    pub drafts: Vec<u32>,
    /// A completion of an `n`-way request whose shared prompt ends inside a block: that block
    /// (one reference on it), to copy into its own before it first writes (`BlockFork`). Let go
    /// once the step that copies it is applied, or when the completion is evicted.
    pub fork_from: Option<BlockTable>,
}

impl Seq {
    pub fn new(tokens: Vec<u32>, table: BlockTable, state: SeqState) -> Seq {
        Seq {
            tokens,
            computed: 0,
            table,
            state,
            hashes: Vec::new(),
            registered: 0,
            drafts: Vec::new(),
            fork_from: None,
        }
    }

    pub fn uncomputed(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Gives the blocks back and forgets the cache, so the sequence is recomputed from scratch.
    pub fn evict(&mut self) {
        self.table.release();
        self.fork_from = None;
        self.computed = 0;
        self.registered = 0;
        self.drafts.clear();
    }
}

/// Which drafts the backend verifies exactly beyond greedy draws on unshaped logits
/// (`Backend::verifies_sampled_drafts`, `verifies_shaped_drafts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verifies {
    /// Sampled (non-greedy) draws, by rejection sampling.
    pub sampled: bool,
    /// Rows shaped by penalties over the drafts before them, by `logit_bias`, and by a grammar's
    /// mask after the drafts before them.
    pub shaped: bool,
}

/// Whose fair share of the batch a request counts against (`GenerateRequest::owner`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owner {
    /// A request that names no owner is its own.
    Request(u64),
    /// An owner several requests named.
    Shared(u64),
}

/// A request as the scheduler tracks it.
#[derive(Debug)]
pub struct Group {
    pub req: GenerateRequest,
    pub owner: Owner,
    /// The request seed, or one the engine drew for it.
    pub seed: u64,
    /// The prompt's leading full blocks, prefilled once and shared by all completions; `Some`
    /// only until it has been computed (the completions' tables keep the blocks alive after).
    pub prefix: Option<Seq>,
    pub completions: Vec<Seq>,
    /// Prompt tokens found in the prefix cache when the request was admitted.
    pub cached_tokens: usize,
    /// Gathered while the prompt is computed, when the request asked for them.
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// Structured output: one constraint per completion, or none at all.
    pub constraints: Constraints,
    /// Its grammar's masks along drafts took longer than `SLOW_LOOKAHEAD` once: it decodes one
    /// token per step from then on (`Scheduler::fill_masks`).
    pub grammar_too_slow_to_draft: bool,
}

/// The `TokenConstraint` of each completion of a constrained request (empty otherwise).
#[derive(Default)]
pub struct Constraints(pub Vec<Box<dyn TokenConstraint>>);

impl Constraints {
    pub fn for_request(req: &GenerateRequest) -> Constraints {
        Constraints(req.constraint.as_ref().map(|f| (0..req.n).map(|_| (f.0)()).collect()).unwrap_or_default())
    }
}

impl std::fmt::Debug for Constraints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraints({})", self.0.len())
    }
}

impl Group {
    /// Cached prefix blocks may stand in for computing the prompt only once the prompt's
    /// logprobs, if asked for, are complete (a cached block has no logits).
    pub fn may_reuse_cache(&self) -> bool {
        self.prompt_logprobs.as_ref().is_none_or(|p| p.complete())
    }

    pub fn prompt_len(&self) -> usize {
        self.req.prompt_tokens.len()
    }

    pub fn seq(&self, slot: Slot) -> Option<&Seq> {
        match slot {
            Slot::Prefix => self.prefix.as_ref(),
            Slot::Completion(i) => self.completions.get(i),
        }
    }

    pub fn seq_mut(&mut self, slot: Slot) -> Option<&mut Seq> {
        match slot {
            Slot::Prefix => self.prefix.as_mut(),
            Slot::Completion(i) => self.completions.get_mut(i),
        }
    }

    pub fn unfinished(&self) -> impl Iterator<Item = usize> + '_ {
        self.completions.iter().enumerate().filter(|(_, s)| !matches!(s.state, SeqState::Finished(_))).map(|(i, _)| i)
    }

    pub fn is_finished(&self) -> bool {
        self.unfinished().next().is_none()
    }

    /// Appends completion `i`'s sampled token and decides whether it ends the completion; a
    /// finished completion gives its blocks back at once. `Err` when its constraint refused
    /// the token or failed following it: the request is then rejected (the engine removes it).
    pub fn push_token(&mut self, i: usize, token: u32, max_model_len: usize) -> Result<Option<FinishReason>, String> {
        let (prompt_len, max_tokens) = (self.prompt_len(), self.req.max_tokens);
        let seq = &mut self.completions[i];
        seq.tokens.push(token);
        let len = seq.tokens.len();
        if let Some(why) = self.constraints.0.get_mut(i).map(|c| c.accept(token)).and_then(Result::err) {
            // The sampler only draws allowed tokens, so either following the grammar failed (a
            // limit of the grammar engine) or it is a bug; the request ends visibly rather than
            // going on unconstrained.
            tracing::warn!("completion {i} left its structured-output grammar at token {token}: {why}");
            return Err(why);
        }
        let reason = if self.req.stop_token_ids.contains(&token) {
            FinishReason::Stop
        } else if len - prompt_len >= max_tokens || len >= max_model_len {
            FinishReason::Length
        } else {
            return Ok(None);
        };
        self.finish(i, reason);
        Ok(Some(reason))
    }

    /// Ends completion `i` and gives its blocks back (shared prefix blocks stay with the
    /// completions that still hold them). False if it had already finished.
    pub fn finish(&mut self, i: usize, reason: FinishReason) -> bool {
        let seq = &mut self.completions[i];
        if matches!(seq.state, SeqState::Finished(_)) {
            return false;
        }
        seq.state = SeqState::Finished(reason);
        seq.evict();
        true
    }

    /// Whether this request's completions may be decoded speculatively: a greedy draw unless the
    /// backend verifies sampled drafts, and no penalties, logit_bias or grammar unless it
    /// verifies rows shaped by them (`Verifies`; a grammar's verify rows each get the mask after
    /// the drafts before them, `Scheduler::fill_masks`), and no grammar too slow to follow them.
    pub fn may_speculate(&self, verifies: Verifies) -> bool {
        let s = &self.req.sampling;
        let shaped = s.has_penalties() || !self.req.logit_bias.is_empty() || !self.constraints.0.is_empty();
        (verifies.sampled || s.is_greedy()) && (verifies.shaped || !shaped) && !self.grammar_too_slow_to_draft
    }

    /// Whether the request samples with a seed of its own: its tokens must not depend on which
    /// steps draft (the measured load rule leaves its drafting alone).
    pub fn pins_draws(&self) -> bool {
        self.req.seed.is_some() && !self.req.sampling.is_greedy()
    }

    /// Whether completion `i` drafts now: `min_tokens`, while it holds, bans the stop tokens
    /// row by row.
    pub fn drafts_now(&self, i: usize, verifies: Verifies) -> bool {
        self.may_speculate(verifies)
            && (self.outputs(i).len() >= self.req.min_tokens || self.req.stop_token_ids.is_empty())
    }

    /// Outputs completion `i` has produced so far.
    pub fn outputs(&self, i: usize) -> &[u32] {
        &self.completions[i].tokens[self.prompt_len()..]
    }
}
