//! Building the sequences of a prefill or a decode step.

use super::Scheduler;
use crate::prompt_logprobs::LOGITS_CHUNK;
use crate::sequence::{draw_seed, Group, SeqKey, SeqState, Slot};
use mla_core::plan::{LogitsRequest, PenaltyTokens, SampleRequest, SeqStep};

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

    /// Prompt chunks within `max_num_batched_tokens`: resident sequences first, then admissions.
    pub(super) fn build_prefill(&mut self) -> Vec<SeqStep> {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut steps = Vec::new();
        let mut add = |this: &mut Self, key: SeqKey, budget: &mut usize| {
            if *budget > 0 && this.needs_prefill(key) {
                let step = this.chunk(key, *budget);
                *budget -= step.tokens.len();
                steps.push(step);
            }
        };
        for i in 0..self.running.len() {
            add(self, self.running[i], &mut budget);
        }
        while budget > 0 {
            let Some(keys) = self.admit_next() else { break };
            for key in keys {
                add(self, key, &mut budget);
            }
        }
        steps
    }

    /// One token for every decodable sequence, oldest first, preempting the newest sequences
    /// when a block boundary needs a block and none is free.
    pub(super) fn build_decode(&mut self) -> Vec<SeqStep> {
        let mut steps = Vec::with_capacity(self.running.len());
        let mut i = 0;
        while i < self.running.len() {
            let key = self.running[i];
            // One lookup per sequence in the common case: decodable, and its next token fits
            // the blocks it holds or the free ones.
            let g = self.groups.get_mut(&key.request).expect("running sequence exists");
            if decodable(g, key.slot) {
                let seq = g.seq_mut(key.slot).expect("running sequence exists");
                if seq.table.reserve(seq.tokens.len()).is_ok() {
                    steps.push(entry(g, key, 1, &mut self.spare));
                } else if self.make_room(key) {
                    steps.push(self.chunk(key, 1));
                } else {
                    // `key` was the newest resident sequence, so nothing follows it.
                    break;
                }
            }
            i += 1;
        }
        steps
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

    /// The next `at_most` uncomputed tokens of `key`, sampling when they reach its end.
    fn chunk(&mut self, key: SeqKey, at_most: usize) -> SeqStep {
        entry(&self.groups[&key.request], key, at_most, &mut self.spare)
    }
}

/// See `Scheduler::is_decodable`.
fn decodable(g: &Group, slot: Slot) -> bool {
    let Slot::Completion(i) = slot else { return false };
    let s = &g.completions[i];
    g.prefix.is_none() && s.state == SeqState::Running && s.computed > 0 && s.uncomputed() == 1
}

/// The plan entry of `Scheduler::chunk`, reusing the vectors of a recycled entry when there is
/// any (`Scheduler::recycle`).
fn entry(g: &Group, key: SeqKey, at_most: usize, spare: &mut Vec<SeqStep>) -> SeqStep {
    let seq = g.seq(key.slot).expect("resident sequence exists");
    let mut end = seq.computed + seq.uncomputed().min(at_most);
    let logits = match &g.prompt_logprobs {
        // One sequence per plan asks for the rows of positions still missing (see `claim`).
        Some(p) if p.claim(seq.computed, end.min(seq.computed + LOGITS_CHUNK)) => {
            end = end.min(seq.computed + LOGITS_CHUNK);
            LogitsRequest::All
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
    SeqStep { seq_id: key.seq_id(), tokens, context_len: seq.computed, block_table, logits, sample }
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
