//! Continuous batching: requests join and leave at every step. Each step is a prefill batch, a
//! decode batch or both (`StepKind`), built from the sequences resident in the cache plus
//! whatever can be admitted.
//!
//! Policy:
//! - Prefill steps carry prompt chunks, at most `max_num_batched_tokens` tokens in all, and at
//!   most `long_prefill_token_threshold` of one sequence when it is set (so a long prompt leaves
//!   room for the ones behind it). Resident sequences that still need prefill go first (oldest
//!   first), then the admission queue: preempted sequences before new requests, each in FIFO
//!   order, stopping at the first that does not fit (so a large request is never overtaken
//!   forever) — except that the owner with the fewest resident completions goes first (see
//!   `fairness`).
//! - Fair shares: requests belong to owners (one HTTP request's prompts share one). When the
//!   next admission does not fit and its owner holds less than its share of `max_num_seqs`
//!   (split evenly over the owners with work), an owner holding more than its share gives up
//!   its newest decoding completion (preempted, recomputed later). So one request with many
//!   prompts or a large `n` cannot hold the batch while others wait.
//! - Decode steps feed one token for every resident sequence that has sampled and is waiting.
//! - Fairness: while both kinds of work exist, steps alternate prefill / decode. A decode's
//!   inter-token latency therefore grows by at most one budget-bounded prefill step while a long
//!   prompt is prefilled in chunks, and prompts still advance on every other step.
//! - Mixed steps (`mixed_steps`): instead of alternating, every step feeds each decodable
//!   sequence its token and fills the rest of the token budget with prompt chunks
//!   (`StepKind::Mixed`), as vLLM's scheduler does: decoding never pauses for a prompt, and
//!   the FFN weights are read once for both kinds of rows.
//! - Admission reserves blocks for everything the sequence will feed before its first decode;
//!   decode steps allocate one block when a sequence crosses a block boundary. When none is
//!   free, the newest resident sequence is preempted: its blocks are freed and it is re-queued
//!   to be recomputed (prompt + outputs so far prefilled again). Seeds depend only on
//!   (request seed, completion, output index), so preemption never changes outputs.
//! - `n > 1`: the prompt up to its last token is prefilled once as a shared prefix; every
//!   completion's table shares its full blocks (ref-counted), takes its own copy of the block
//!   the prefix ends in (`BlockFork`, made by the backend before the completion's first step
//!   writes) and computes the last prompt token itself, so its first sample comes from its own
//!   row and nobody writes into a shared block. A backend that does not copy blocks
//!   (`fork_blocks` off) shares only the full blocks before the one holding the last prompt
//!   token, and each completion recomputes that block (1..=block_size tokens).
//! - Prefix caching (`prefix_caching`): full blocks are registered in the block manager under
//!   the hash of their content once computed (prompt and generated tokens alike), and stay
//!   cached after their sequences end until their space is needed. Admission (new or resumed
//!   after preemption) takes the longest cached run of the sequence's leading blocks and
//!   prefills only the rest, always recomputing at least the block that holds the last prompt
//!   token, so the first sample has fresh logits and nobody writes into a shared block.
//! - Prompt logprobs (`prompt_logprobs`): prompt chunks that compute positions still missing
//!   ask for all their logits and are cut to `prompt_logprobs::LOGITS_CHUNK` tokens; until the
//!   request has them all, admission takes nothing from the prefix cache.
//! - A completion can be ended from outside (`finish_completion`: a stop string only the caller
//!   sees). It leaves the running set or the resume queue at once, its blocks go back, and a
//!   request still waiting is admitted with only its live completions.

use crate::api::{FinishReason, GenerateRequest, PromptTokenLogprob};
use crate::block_manager::BlockManager;
use crate::cache_index::CachePublisher;
use crate::id_map::IdMap;
use crate::prefix_hash::{BlockHash, PrefixHasher};
use crate::prompt_logprobs::PromptLogprobs;
use crate::sequence::{Constraints, Group, Owner, Seq, SeqKey, SeqState, Slot};
use mla_core::step::plan::{SampledToken, SeqStep, StepOutput};
use mla_core::{CacheLayout, StepKind, StepPlan};
use std::collections::VecDeque;

mod admission;
mod constraints;
mod fairness;
mod steps;

pub use admission::{blocks_to_admit, reusable_blocks, shared_prefix_len};
pub use constraints::FilledMasks;

/// The limits scheduling obeys (a subset of `EngineConfig`).
#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Most prompt tokens one sequence feeds in a step (`EngineConfig::long_prefill_token_threshold`).
    pub long_prefill_token_threshold: Option<usize>,
    /// Logit rows a step may return beyond one per sampled sequence: prompt-logprob chunks
    /// share them (`mla_core::StepLimits::extra_logit_rows`).
    pub max_extra_logit_rows: usize,
    /// Keep computed blocks by content and reuse them for prompts that start the same way.
    pub prefix_caching: bool,
    /// Put the decode rows and the prompt chunks of a step together (`StepKind::Mixed`) instead
    /// of alternating prefill and decode steps.
    pub mixed_steps: bool,
    /// Speculative decoding with the model's MTP layer: drafts per step (0: off). Requests that
    /// can be verified exactly draft (`Group::may_speculate`); the others decode as without.
    pub mtp_drafts: usize,
    /// Drafting pauses while at least this many sequences run (`None`: never): past some batch
    /// size a verify step's extra rows cost more than the accepted drafts save
    /// (docs/speculative-decoding.md, "When it pays"). Rows then run without the MTP layer, whose
    /// cache misses those positions: acceptance dips for a while after drafting resumes,
    /// correctness does not change.
    pub spec_disable_batch: Option<usize>,
    /// Whether the backend verifies drafts of sampled draws (`Backend::verifies_sampled_drafts`);
    /// without it only greedy requests draft.
    pub spec_sampled: bool,
    /// Whether the backend verifies drafts of requests with penalties or logit_bias
    /// (`Backend::verifies_shaped_drafts`); without it those requests do not draft.
    pub spec_shaped: bool,
    /// Whether the backend copies cache blocks (`Backend::forks_blocks`): then the completions of
    /// an `n`-way request share the prompt up to its last token (`shared_prefix_len`).
    pub fork_blocks: bool,
}

/// Prefix-cache counters since start, in prompt tokens (vLLM's `prefix_cache_queries` and
/// `prefix_cache_hits`): what admissions looked up, and what they found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub queries: u64,
    pub hits: u64,
}

/// A token a completion produced in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutcome {
    pub request: u64,
    pub index: usize,
    pub token: SampledToken,
    pub finish: Option<FinishReason>,
}

/// What applying one step's output changed.
#[derive(Debug, Default)]
pub struct Applied {
    /// Requests whose prompt logprobs became complete, delivered before their tokens.
    pub prompt_logprobs: Vec<(u64, Vec<PromptTokenLogprob>)>,
    pub tokens: Vec<TokenOutcome>,
    /// Requests whose completions have all finished; the scheduler has forgotten them.
    pub finished_requests: Vec<u64>,
    /// Requests whose constraint refused a drawn token or failed following it, with why: the
    /// engine rejects them (their token is not among `tokens`).
    pub rejected: Vec<(u64, String)>,
}

/// What `Scheduler::finish_completion` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EarlyFinish {
    /// Just that completion; others of its request are still live.
    Completion,
    /// The request's last live completion: the scheduler has forgotten the request.
    Request,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    blocks: BlockManager,
    groups: IdMap<Group>,
    /// New requests in arrival order.
    new_queue: VecDeque<u64>,
    /// Preempted completions, admitted before any new request.
    resume_queue: VecDeque<SeqKey>,
    /// Resident sequences in admission order; the last one is preempted first.
    running: Vec<SeqKey>,
    last_kind: Option<StepKind>,
    preemptions: u64,
    /// Entries of finished plans (`recycle`), refilled by the next ones so that a step's token
    /// and block-table vectors do not cost an allocation per sequence.
    spare: Vec<SeqStep>,
    hasher: PrefixHasher,
    prefix_stats: PrefixCacheStats,
    /// Requests admitted for the first time since the last `take_admitted`, with the prompt
    /// tokens the cache held for them.
    admitted: Vec<(u64, usize)>,
    /// Structured-output masks the last plan is waiting for (`fill_masks`).
    mask_jobs: Vec<(SeqKey, constraints::MaskJob)>,
    /// Speculative decoding's counts since start.
    spec: SpecStats,
    /// Whether drafting is paused by `SchedulerConfig::spec_disable_batch` (logged as it turns).
    spec_paused: bool,
    /// The engine's measured load rule ruled the steps being built out of drafting
    /// (`rule_out_drafting`).
    spec_ruled_out: bool,
}

/// How speculative decoding has fared since start (vLLM's `spec_decode_*` counters).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Decode rows that fed drafts.
    pub drafts: u64,
    /// Drafted tokens fed for verification.
    pub draft_tokens: u64,
    /// Of those, the ones that stood.
    pub accepted_tokens: u64,
    /// Per draft position (0 first), how often the draft there stood.
    pub accepted_per_pos: Vec<u64>,
}

impl SpecStats {
    fn record(&mut self, fed: usize, stood: usize) {
        self.drafts += 1;
        self.draft_tokens += fed as u64;
        self.accepted_tokens += stood as u64;
        if self.accepted_per_pos.len() < fed {
            self.accepted_per_pos.resize(fed, 0);
        }
        for p in &mut self.accepted_per_pos[..stood] {
            *p += 1;
        }
    }

    /// Adds another rank's counts.
    pub fn merge(&mut self, o: &SpecStats) {
        self.drafts += o.drafts;
        self.draft_tokens += o.draft_tokens;
        self.accepted_tokens += o.accepted_tokens;
        if self.accepted_per_pos.len() < o.accepted_per_pos.len() {
            self.accepted_per_pos.resize(o.accepted_per_pos.len(), 0);
        }
        for (a, b) in self.accepted_per_pos.iter_mut().zip(&o.accepted_per_pos) {
            *a += b;
        }
    }
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, layout: CacheLayout) -> Self {
        Self::build(cfg, BlockManager::new(layout), PrefixHasher::default())
    }

    /// A scheduler whose prefix cache the engine's router sees: blocks are hashed with `hasher`
    /// (the engine's, the same on every rank, so one chain of a prompt's hashes is looked up in
    /// all of them) and every registration and eviction goes to `publisher` (`cache_index`).
    pub fn published(
        cfg: SchedulerConfig,
        layout: CacheLayout,
        hasher: PrefixHasher,
        publisher: CachePublisher,
    ) -> Self {
        Self::build(cfg, BlockManager::published(layout, publisher), hasher)
    }

    fn build(cfg: SchedulerConfig, blocks: BlockManager, hasher: PrefixHasher) -> Self {
        Scheduler {
            cfg,
            blocks,
            groups: IdMap::default(),
            new_queue: VecDeque::new(),
            resume_queue: VecDeque::new(),
            running: Vec::new(),
            last_kind: None,
            preemptions: 0,
            spare: Vec::new(),
            hasher,
            prefix_stats: PrefixCacheStats::default(),
            admitted: Vec::new(),
            mask_jobs: Vec::new(),
            spec: SpecStats::default(),
            spec_paused: false,
            spec_ruled_out: false,
        }
    }

    /// Whether the engine's measured load rule rules the next steps out of drafting (but for
    /// seeded sampled requests, `Group::pins_draws`).
    pub fn rule_out_drafting(&mut self, ruled_out: bool) {
        self.spec_ruled_out = ruled_out;
    }

    /// Speculative decoding's counts since start.
    pub fn spec_stats(&self) -> &SpecStats {
        &self.spec
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.prefix_stats
    }

    /// Requests admitted for the first time since the last call, with their cached prompt
    /// tokens (`usage.prompt_tokens_details.cached_tokens`).
    pub fn take_admitted(&mut self) -> Vec<(u64, usize)> {
        std::mem::take(&mut self.admitted)
    }

    pub fn block_manager(&self) -> &BlockManager {
        &self.blocks
    }

    pub fn has_work(&self) -> bool {
        !self.groups.is_empty()
    }

    pub fn contains(&self, request: u64) -> bool {
        self.groups.contains_key(&request)
    }

    /// Completions resident in the cache.
    pub fn num_running(&self) -> usize {
        self.running.iter().filter(|k| k.slot != Slot::Prefix).count()
    }

    /// Completions waiting for admission (new or preempted).
    pub fn num_waiting(&self) -> usize {
        let states = self.groups.values().flat_map(|g| g.completions.iter());
        states.filter(|s| s.state == SeqState::Waiting).count()
    }

    /// Sequences preempted since start.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Queues a request; `seed` is the request's seed or one drawn for it.
    pub fn add(&mut self, id: u64, req: GenerateRequest, seed: u64) {
        assert!(!self.groups.contains_key(&id), "request {id} added twice");
        // More completions than `max_num_seqs` could never be admitted; the engine refuses them.
        assert!(
            req.n >= 1 && req.n <= self.cfg.max_num_seqs,
            "request {id}: n = {} outside 1..={}",
            req.n,
            self.cfg.max_num_seqs
        );
        let completions = (0..req.n)
            .map(|_| Seq::new(req.prompt_tokens.clone(), self.blocks.new_table(), SeqState::Waiting))
            .collect();
        let owner = req.owner.map_or(Owner::Request(id), Owner::Shared);
        let prompt_logprobs = req.prompt_logprobs.map(|k| PromptLogprobs::new(req.prompt_tokens.len(), k));
        let constraints = Constraints::for_request(&req);
        let group = Group {
            req,
            owner,
            seed,
            prefix: None,
            completions,
            cached_tokens: 0,
            prompt_logprobs,
            constraints,
            grammar_too_slow_to_draft: false,
        };
        self.groups.insert(id, group);
        self.new_queue.push_back(id);
    }

    /// `add` for a request whose prompt's leading block hashes the caller already worked out
    /// with this scheduler's hasher (the router did, to find the rank holding them), so that
    /// admission does not hash the prompt again. Hashes beyond the blocks admission may take
    /// from the cache (`reusable_blocks`) are dropped.
    pub fn add_hashed(&mut self, id: u64, req: GenerateRequest, seed: u64, mut hashes: Vec<BlockHash>) {
        hashes.truncate(reusable_blocks(req.prompt_tokens.len(), self.blocks.block_size()));
        self.add(id, req, seed);
        self.groups.get_mut(&id).expect("just added").completions[0].hashes = hashes;
    }

    /// Forgets a request (abort, failure, client gone), freeing its blocks. Returns the indices
    /// of its completions that had not finished, or `None` for an unknown id.
    pub fn remove_request(&mut self, id: u64) -> Option<Vec<usize>> {
        let group = self.groups.remove(&id)?;
        self.running.retain(|k| k.request != id);
        self.resume_queue.retain(|k| k.request != id);
        self.new_queue.retain(|&r| r != id);
        Some(group.unfinished().collect())
        // Dropping `group` drops every table: the blocks go back to the pool.
    }

    /// Ends completion `index` of `request` for the caller (a stop string the engine cannot see),
    /// wherever it is: resident (its blocks are freed now), waiting for admission or preempted.
    /// The other completions are untouched. `None` when there was nothing to end: unknown
    /// request, index out of range or already finished.
    pub fn finish_completion(&mut self, request: u64, index: usize, reason: FinishReason) -> Option<EarlyFinish> {
        let g = self.groups.get_mut(&request)?;
        if index >= g.completions.len() || !g.finish(index, reason) {
            return None;
        }
        let key = SeqKey { request, slot: Slot::Completion(index) };
        self.running.retain(|&k| k != key);
        self.resume_queue.retain(|&k| k != key);
        if g.is_finished() {
            self.remove_request(request);
            return Some(EarlyFinish::Request);
        }
        Some(EarlyFinish::Completion)
    }

    /// Builds the next step, or `None` when nothing can run. Prefill and decode steps alternate
    /// while both kinds of work exist.
    pub fn schedule(&mut self) -> Option<StepPlan> {
        let decodable = self.running.iter().any(|&k| self.is_decodable(k));
        let prefill_first = !decodable || self.last_kind == Some(StepKind::Decode);
        self.schedule_prefer(if prefill_first { StepKind::Prefill } else { StepKind::Decode })
    }

    /// Builds a step of kind `kind` if there is work of that kind, else of the other kind. The
    /// engine uses it to line up the kinds of DP-attention ranks, which step together: a rank
    /// that prefills while the others decode makes them wait for it.
    pub fn schedule_prefer(&mut self, kind: StepKind) -> Option<StepPlan> {
        if self.cfg.mixed_steps {
            return self.schedule_mixed();
        }
        let other = match kind {
            StepKind::Decode => StepKind::Prefill,
            _ => StepKind::Decode,
        };
        for kind in [kind, other] {
            let seqs = match kind {
                StepKind::Decode => self.build_decode(),
                _ => self.build_prefill(self.cfg.max_num_batched_tokens),
            };
            if !seqs.is_empty() {
                self.last_kind = Some(kind);
                let mut plan = StepPlan { kind, seqs };
                self.attach_masks(&mut plan);
                return Some(plan);
            }
        }
        None
    }

    /// Every decodable sequence's next token, then prompt chunks in what is left of the token
    /// budget; a step of one kind when there is only one kind of work. Decode rows go first so
    /// that prompts never delay them: a sequence's inter-token latency is one step, whose length
    /// the budget bounds.
    fn schedule_mixed(&mut self) -> Option<StepPlan> {
        let mut seqs = self.build_decode();
        let fed: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let budget = self.cfg.max_num_batched_tokens.saturating_sub(fed);
        let preemptions = self.preemptions;
        let prefill = if budget > 0 { self.build_prefill(budget) } else { Vec::new() };
        // Admitting a prompt may have preempted a decoding completion for fairness (its blocks
        // are gone), and may even have admitted it again (other blocks, or a prompt chunk of its
        // history): its row leaves the step unless the sequence stands exactly as it was built.
        // Only a preemption can do that, so the rows are checked only after one.
        if self.preemptions != preemptions {
            let (kept, stale): (Vec<SeqStep>, Vec<SeqStep>) = seqs.into_iter().partition(|e| self.decode_row_stands(e));
            self.spare.extend(stale);
            seqs = kept;
        }
        if seqs.is_empty() && prefill.is_empty() {
            // Admission can bring in a sequence with nothing to prefill: a resumed completion
            // whose history, all but its last token, is in the prefix cache. It decodes now.
            seqs = self.build_decode();
        }
        let decode = seqs.len();
        let kind = match (prefill.len(), decode) {
            (0, 0) => return None,
            (0, _) => StepKind::Decode,
            (_, 0) => StepKind::Prefill,
            (p, _) => StepKind::Mixed { prefill: p },
        };
        // Prompt chunks first: the plan's order is the path order (`StepPlan::split`).
        seqs.splice(0..0, prefill);
        self.last_kind = Some(kind);
        let mut plan = StepPlan { kind, seqs };
        self.attach_masks(&mut plan);
        Some(plan)
    }

    /// Whether decode row `e` still describes its sequence: decodable, at the same position,
    /// over the same blocks.
    fn decode_row_stands(&self, e: &SeqStep) -> bool {
        let key = SeqKey::from_seq_id(e.seq_id);
        self.is_decodable(key)
            && self.groups[&key.request]
                .seq(key.slot)
                .is_some_and(|s| s.computed == e.context_len && s.table.blocks() == e.block_table.as_slice())
    }

    /// Takes back a plan the backend is done with; its vectors are reused by later plans.
    pub fn recycle(&mut self, plan: StepPlan) {
        self.spare.extend(plan.seqs);
    }

    /// Records a successful step. `out` must answer `plan` seq by seq (the engine checks).
    pub fn apply(&mut self, plan: &StepPlan, out: &StepOutput) -> Applied {
        let mut applied = Applied { tokens: Vec::with_capacity(plan.seqs.len()), ..Applied::default() };
        for (step, res) in plan.seqs.iter().zip(&out.seqs) {
            let key = SeqKey::from_seq_id(step.seq_id);
            let Some(g) = self.groups.get_mut(&key.request) else { continue };
            if let Some(p) = g.prompt_logprobs.as_mut() {
                p.record(&g.req.prompt_tokens, step.context_len, &res.scores);
                // Complete at the latest in the step that samples the first token.
                if let Some(entries) = p.take_complete() {
                    applied.prompt_logprobs.push((key.request, entries));
                }
            }
            let seq = g.seq_mut(key.slot).expect("scheduled sequence exists");
            debug_assert_eq!(seq.computed, step.context_len, "plan applied out of order");
            if step.fork.is_some() {
                // Copied: the block it came from may go.
                seq.fork_from = None;
            }
            // Speculative decoding: of the drafts fed, those that stood are in the cache now
            // (they are the step's first emitted tokens); the rows of the others are garbage
            // that later steps overwrite.
            let (fed, stood) = (step.drafts_fed(), res.extra_tokens.len());
            seq.computed += step.tokens.len() - fed + stood;
            if fed > 0 {
                self.spec.record(fed, stood);
            }
            if self.cfg.prefix_caching {
                // The blocks the drafts that stood complete are hashed with their tokens, which
                // join the sequence only as they are emitted below.
                let before = seq.tokens.len();
                seq.tokens.extend(res.sampled.iter().chain(&res.extra_tokens).take(stood).map(|t| t.token));
                register_computed_blocks(&self.hasher, seq, self.blocks.block_size());
                seq.tokens.truncate(before);
            }
            let leaves = match (key.slot, &res.sampled) {
                (Slot::Prefix, _) => {
                    let computed = seq.uncomputed() == 0;
                    if computed {
                        // The completions' tables keep the shared blocks alive.
                        g.prefix = None;
                    }
                    computed
                }
                (Slot::Completion(i), Some(first)) => {
                    let mut leaves = false;
                    for tok in std::iter::once(first).chain(&res.extra_tokens) {
                        match g.push_token(i, tok.token, self.cfg.max_model_len) {
                            Ok(finish) => {
                                applied.tokens.push(TokenOutcome {
                                    request: key.request,
                                    index: i,
                                    token: tok.clone(),
                                    finish,
                                });
                                if finish.is_some() {
                                    leaves = true;
                                    break;
                                }
                            }
                            Err(why) => {
                                applied.rejected.push((key.request, why));
                                break;
                            }
                        }
                    }
                    if !leaves {
                        g.completions[i].drafts.clone_from(&res.drafts);
                    }
                    leaves
                }
                (Slot::Completion(_), None) => false,
            };
            if !leaves {
                continue;
            }
            self.running.retain(|&k| k != key);
            if g.is_finished() {
                self.remove_request(key.request);
                applied.finished_requests.push(key.request);
            }
        }
        applied
    }
}

/// Offers every block of `seq` that its computed tokens now fill to the prefix cache.
fn register_computed_blocks(hasher: &PrefixHasher, seq: &mut Seq, block_size: usize) {
    let full = seq.computed / block_size;
    if full <= seq.registered {
        return;
    }
    hasher.extend(&mut seq.hashes, &seq.tokens, seq.computed, block_size);
    for i in seq.registered..full.min(seq.table.len()) {
        seq.table.register(i, seq.hashes[i]);
    }
    seq.registered = full;
}
