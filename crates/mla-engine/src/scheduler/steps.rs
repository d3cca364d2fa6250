//! Building the sequences of a prefill or a decode step.

use super::Scheduler;
use crate::prompt_logprobs::LOGITS_CHUNK;
use crate::sequence::{draw_seed, Group, SeqKey, SeqState, Slot, Verifies};
use mla_core::step::plan::{BlockFork, LogitsRequest, MtpStep, PenaltyTokens, SampleRequest, SeqStep};

impl Scheduler {
    /// A completion that has sampled a token and now only has to feed it.
    pub(super) fn is_decodable(&self, key: SeqKey) -> bool {
        decodable(&self.groups[&key.request], key.slot)
    }

    /// Resident and still short of its first (or, after preemption, next) sample. Completions
    /// wait while their group's shared prefix is being computed, as they attend to it.
    fn needs_prefill(&self, key: SeqKey) -> bool {
        let g = &self.groups[&key.request];
        match key.slot {
            Slot::Prefix => g.prefix.as_ref().is_some_and(|p| p.uncomputed() > 0),
            Slot::Completion(i) => {
                let s = &g.completions[i];
                g.prefix.is_none() && s.state == SeqState::Running && s.uncomputed() > 0 && !self.is_decodable(key)
            }
        }
    }

    /// Prompt chunks within `tokens`, and prompt-logprob rows within `max_extra_logit_rows`:
    /// resident sequences first, then admissions. A chunk that wants logits when none are left
    /// waits for the next step.
    pub(super) fn build_prefill(&mut self, tokens: usize) -> Vec<SeqStep> {
        let mut left = Left { tokens, logit_rows: self.cfg.max_extra_logit_rows };
        let mut steps = Vec::new();
        let drafting = self.drafting();
        let per_seq = self.cfg.long_prefill_token_threshold.unwrap_or(usize::MAX);
        let mut add = |this: &mut Self, key: SeqKey, left: &mut Left| {
            if left.tokens > 0 && this.needs_prefill(key) {
                let at_most = left.tokens.min(per_seq);
                let g = &this.groups[&key.request];
                if let Some(step) = entry(g, key, at_most, &mut left.logit_rows, &mut this.spare, drafting) {
                    left.tokens -= step.tokens.len();
                    steps.push(step);
                }
            }
        };
        for i in 0..self.running.len() {
            add(self, self.running[i], &mut left);
        }
        while left.tokens > 0 {
            let Some(keys) = self.admit_next() else { break };
            for key in keys {
                add(self, key, &mut left);
            }
        }
        steps
    }

    /// One token for every decodable sequence, oldest first, preempting the newest sequences
    /// when a block boundary needs a block and none is free. With speculative decoding a row
    /// also feeds the sequence's drafts, when the blocks for them and the rows drafting writes
    /// are free and the step's token budget has room; otherwise it feeds its one token.
    pub(super) fn build_decode(&mut self) -> Vec<SeqStep> {
        let mut steps = Vec::with_capacity(self.running.len());
        let drafting = self.drafting();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() {
            let key = self.running[i];
            // One lookup per sequence in the common case: decodable, and its next token fits
            // the blocks it holds or the free ones.
            let g = self.groups.get_mut(&key.request).expect("running sequence exists");
            if decodable(g, key.slot) {
                let speculate = match (drafting, key.slot) {
                    (Some(d), Slot::Completion(c)) => d.fits_row(g, c, budget),
                    _ => false,
                };
                let seq = g.seq_mut(key.slot).expect("running sequence exists");
                let with_drafts =
                    speculate && drafting.is_some_and(|d| seq.table.reserve(d.row_positions(seq)).is_ok());
                let entry = if with_drafts || seq.table.reserve(seq.tokens.len()).is_ok() {
                    decode_entry(g, key, &mut self.spare, drafting, with_drafts)
                } else if self.make_room(key) {
                    decode_entry(&self.groups[&key.request], key, &mut self.spare, drafting, false)
                } else {
                    // `key` was the newest resident sequence, so nothing follows it.
                    break;
                };
                budget = budget.saturating_sub(entry.tokens.len());
                steps.push(entry);
            }
            i += 1;
        }
        steps
    }

    /// What speculative decoding asks of this step's entries, when it is on and not paused by
    /// the batch-size rule (`SchedulerConfig::spec_disable_batch`); where the engine's measured
    /// rule rules drafting out (`rule_out_drafting`), for seeded sampled requests only.
    fn drafting(&mut self) -> Option<Drafting> {
        if self.cfg.mtp_drafts == 0 {
            return None;
        }
        let running = self.running.len();
        let paused = self.cfg.spec_disable_batch.is_some_and(|n| running >= n);
        if paused != self.spec_paused {
            self.spec_paused = paused;
            let limit = self.cfg.spec_disable_batch.unwrap_or(0);
            if paused {
                tracing::info!(
                    "speculative decoding paused: {running} sequences running (disable_by_batch_size {limit})"
                );
            } else {
                tracing::info!(
                    "speculative decoding resumed: {running} sequences running (disable_by_batch_size {limit})"
                );
            }
        }
        (!paused).then_some(Drafting {
            k: self.cfg.mtp_drafts,
            verifies: Verifies { sampled: self.cfg.spec_sampled, shaped: self.cfg.spec_shaped },
            block_size: self.blocks.block_size(),
            max_model_len: self.cfg.max_model_len,
            seeded_only: self.spec_ruled_out,
        })
    }

    /// Reserves the block `key`'s next token lands in. Victims are always newer than `key`
    /// (`running` is in admission order), so none of them is in the step being built. Returns
    /// false when `key` itself had to go.
    fn make_room(&mut self, key: SeqKey) -> bool {
        loop {
            let g = self.groups.get_mut(&key.request).expect("running sequence exists");
            let seq = g.seq_mut(key.slot).expect("running sequence exists");
            if seq.table.reserve(seq.tokens.len()).is_ok() {
                return true;
            }
            let victim = self.preempt_newest().expect("`key` itself is resident");
            if victim == key {
                return false;
            }
        }
    }
}

/// Speculative decoding's parameters for building entries (`SchedulerConfig::mtp_drafts`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Drafting {
    /// Drafts per step.
    k: usize,
    /// Which requests the backend verifies drafts of, beyond greedy ones without shaping.
    verifies: Verifies,
    block_size: usize,
    max_model_len: usize,
    /// The measured load rule ruled this step out of drafting: only requests whose draws are
    /// pinned by a seed draft (`Group::pins_draws`), so their tokens do not depend on it.
    seeded_only: bool,
}

impl Drafting {
    /// Whether request `g` may draft in this step at all (`seeded_only`).
    fn admits(&self, g: &Group) -> bool {
        !self.seeded_only || g.pins_draws()
    }

    /// Positions a decode row with its drafts needs blocks for: the last token, the drafts, and
    /// the `k - 1` rows drafting writes past them.
    fn row_positions(&self, seq: &crate::sequence::Seq) -> usize {
        seq.tokens.len() + seq.drafts.len() + self.k - 1
    }

    /// Whether completion `c` feeds its drafts this step: it has some, may draft now, stays
    /// within the model's length and the step's token budget.
    fn fits_row(&self, g: &Group, c: usize, budget: usize) -> bool {
        let seq = &g.completions[c];
        !seq.drafts.is_empty()
            && self.admits(g)
            && g.drafts_now(c, self.verifies)
            && self.row_positions(seq) <= self.max_model_len
            && seq.drafts.len() < budget
    }

    /// The `MtpStep` of an entry feeding `seq.tokens[computed..end]` (plus `fed` drafts), or
    /// `None` for a request that never drafts (its MTP rows would serve nothing).
    fn step(&self, g: &Group, key: SeqKey, end: usize, samples: bool, fed: usize) -> Option<MtpStep> {
        if !g.may_speculate(self.verifies) || !self.admits(g) {
            return None;
        }
        let seq = g.seq(key.slot).expect("resident sequence exists");
        // A chunk that does not sample names the token after it, for its last MTP row.
        let next_token = match key.slot {
            _ if samples => None,
            Slot::Prefix => g.req.prompt_tokens.get(end).copied(),
            Slot::Completion(_) => seq.tokens.get(end).copied(),
        };
        // Drafting writes rows up to `k - 1` positions past what the step feeds; they must be
        // in the table already (a prompt's last chunk takes what admission reserved).
        let last_drafting_row = end + fed + self.k - 1;
        let draft = match key.slot {
            Slot::Completion(c)
                if samples
                    && g.drafts_now(c, self.verifies)
                    && last_drafting_row <= self.max_model_len
                    && last_drafting_row <= seq.table.len() * self.block_size =>
            {
                self.k
            }
            _ => 0,
        };
        Some(MtpStep { drafts_fed: fed, next_token, draft })
    }
}

/// What a prefill step still has room for.
struct Left {
    tokens: usize,
    /// Logit rows beyond the sampled ones (prompt logprobs).
    logit_rows: usize,
}

/// See `Scheduler::is_decodable`.
fn decodable(g: &Group, slot: Slot) -> bool {
    let Slot::Completion(i) = slot else { return false };
    let s = &g.completions[i];
    g.prefix.is_none() && s.state == SeqState::Running && s.computed > 0 && s.uncomputed() == 1
}

/// A decode step's entry: the one token `key` sampled last, and with `with_drafts` the drafts
/// to verify after it.
fn decode_entry(
    g: &Group,
    key: SeqKey,
    spare: &mut Vec<SeqStep>,
    drafting: Option<Drafting>,
    with_drafts: bool,
) -> SeqStep {
    // A decoding sequence is past its prompt, so it never asks for prompt logits.
    let mut no_limit = usize::MAX;
    let mut e = entry(g, key, 1, &mut no_limit, spare, None).expect("an entry that wants no logits is always built");
    let seq = g.seq(key.slot).expect("resident sequence exists");
    let fed = if with_drafts { seq.drafts.len() } else { 0 };
    e.tokens.extend_from_slice(&seq.drafts[..fed]);
    e.mtp = drafting.and_then(|d| d.step(g, key, seq.computed + 1, true, fed));
    e
}

/// The plan entry of the next `at_most` uncomputed tokens of `key`, sampling when they reach its
/// end, reusing the vectors of a recycled entry when there is any (`Scheduler::recycle`). A
/// chunk that computes missing prompt logprobs takes a logit row per token from `logit_rows`,
/// at most `LOGITS_CHUNK`; None when there are none left.
fn entry(
    g: &Group,
    key: SeqKey,
    at_most: usize,
    logit_rows: &mut usize,
    spare: &mut Vec<SeqStep>,
    drafting: Option<Drafting>,
) -> Option<SeqStep> {
    let seq = g.seq(key.slot).expect("resident sequence exists");
    let mut end = seq.computed + seq.uncomputed().min(at_most);
    let logits = match &g.prompt_logprobs {
        // The first sequence of the plan feeding positions still missing and not yet claimed
        // asks for their rows (`PromptLogprobs::claim`), as many as the step has room for; the
        // others of the plan feed them without rows. A chunk that needs rows when the step has
        // none left waits for the next step.
        Some(p) if p.unclaimed(seq.computed, end) => {
            let rows = (*logit_rows).min(LOGITS_CHUNK);
            if rows == 0 {
                return None;
            }
            end = end.min(seq.computed + rows);
            p.claim(seq.computed, end);
            *logit_rows -= end - seq.computed;
            // Scored where computed: the rows never leave the backend (`LogitsRequest::Scored`).
            let prompt = &g.req.prompt_tokens;
            LogitsRequest::Scored { top: p.top(), after: prompt.get(end).copied() }
        }
        _ => LogitsRequest::None,
    };
    let sample = match key.slot {
        Slot::Completion(i) if end == seq.tokens.len() => Some(sample_request(g, i)),
        _ => None,
    };
    let (mut tokens, mut block_table) = match spare.pop() {
        Some(s) => (s.tokens, s.block_table),
        None => (Vec::new(), Vec::new()),
    };
    tokens.clear();
    tokens.extend_from_slice(&seq.tokens[seq.computed..end]);
    block_table.clear();
    block_table.extend_from_slice(seq.table.blocks());
    let mtp = drafting.and_then(|d| d.step(g, key, end, sample.is_some(), 0));
    // The first write of a completion whose shared prompt ends inside a block goes to its own
    // copy of that block.
    let fork = seq
        .fork_from
        .as_ref()
        .map(|from| BlockFork { from: from.blocks()[0], to: block_table[seq.computed / seq.table.block_size()] });
    Some(SeqStep { seq_id: key.seq_id(), tokens, context_len: seq.computed, block_table, logits, sample, mtp, fork })
}

fn sample_request(g: &Group, i: usize) -> SampleRequest {
    let outputs = g.outputs(i);
    let params = &g.req.sampling;
    // Penalty history is copied only when a penalty needs it: it grows with every token.
    let penalty =
        params.has_penalties().then(|| PenaltyTokens { prompt: g.req.prompt_tokens.clone(), output: outputs.to_vec() });
    SampleRequest {
        params: params.clone(),
        seed: draw_seed(g.seed, i, outputs.len()),
        top_logprobs: g.req.logprobs,
        penalty,
        logit_bias: logit_bias(g, outputs.len()),
        // Filled by `Scheduler::attach_masks` once the plan is built.
        allowed: None,
    }
}

/// The request's logit bias, plus `-inf` on every stop token while fewer than `min_tokens`
/// tokens have been generated (vLLM's `min_tokens`: the stop tokens cannot end it early).
fn logit_bias(g: &Group, generated: usize) -> Vec<(u32, f32)> {
    let req = &g.req;
    if generated >= req.min_tokens || req.stop_token_ids.is_empty() {
        return req.logit_bias.clone();
    }
    let mut bias = req.logit_bias.clone();
    for &t in &req.stop_token_ids {
        match bias.binary_search_by_key(&t, |&(tok, _)| tok) {
            Ok(at) => bias[at].1 = f32::NEG_INFINITY,
            Err(at) => bias.insert(at, (t, f32::NEG_INFINITY)),
        }
    }
    bias
}
