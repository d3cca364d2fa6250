//! Admission into the cache and preemption out of it.

use super::fairness::Candidate;
use super::Scheduler;
use crate::sequence::{Seq, SeqKey, SeqState, Slot};

/// Prompt tokens the completions of an `n`-way request share, computed once for all of them; each
/// completion computes the rest, so its first sample comes from its own row. With `forks` (the
/// backend copies blocks, `Backend::forks_blocks`) that is all but the last prompt token: the
/// block holding the shared part's end is copied into each completion's own (`BlockFork`)
/// before it writes there. Without, the full blocks before the block holding the last prompt
/// token, and each completion recomputes that block (1 ..= block_size tokens), so nobody ever
/// writes into a shared block.
pub fn shared_prefix_len(prompt_len: usize, n: usize, block_size: usize, forks: bool) -> usize {
    if n < 2 || prompt_len == 0 {
        return 0;
    }
    if forks {
        prompt_len - 1
    } else {
        (prompt_len - 1) / block_size * block_size
    }
}

/// Leading full blocks of a sequence of `len` tokens that admission may take from the prefix
/// cache: those before the block holding the last token, which is always recomputed (its
/// logits are needed, and a block that is recomputed is never one somebody else reads).
pub fn reusable_blocks(len: usize, block_size: usize) -> usize {
    len.saturating_sub(1) / block_size
}

/// Blocks a new request reserves when admitted: the shared prefix once, plus each completion's
/// own blocks for the rest of the prompt (with forks, its copy of the block the shared part ends
/// in too).
pub fn blocks_to_admit(prompt_len: usize, n: usize, block_size: usize, forks: bool) -> usize {
    let shared = shared_prefix_len(prompt_len, n, block_size, forks);
    let (whole, touched) = (shared / block_size, shared.div_ceil(block_size));
    touched + n * (prompt_len.div_ceil(block_size) - whole)
}

impl Scheduler {
    pub(super) fn running_completions(&self) -> usize {
        self.running.iter().filter(|k| k.slot != Slot::Prefix).count()
    }

    /// Admits the next candidate of the queues (`next_candidate`: preempted sequences before
    /// new requests, FIFO, the owners holding least first) if it fits within `max_num_seqs` and
    /// the free blocks, making room at the expense of owners above their fair share; returns
    /// the keys that became resident.
    pub(super) fn admit_next(&mut self) -> Option<Vec<SeqKey>> {
        loop {
            let candidate = self.next_candidate()?;
            let admitted = match candidate {
                Candidate::Resume(key) => self.admit_resume(key).then(|| {
                    self.resume_queue.pop_front();
                    vec![key]
                }),
                Candidate::New { id, position } => self.admit_new(id).inspect(|_| {
                    self.new_queue.remove(position);
                }),
            };
            if admitted.is_some() || !self.preempt_for_fairness(candidate) {
                return admitted;
            }
        }
    }

    /// Admits a new request's completions, leaving out any the caller finished while it waited
    /// (they need no blocks, and a lone survivor needs no shared prefix). With prefix caching,
    /// the prompt's leading blocks found in the cache are taken instead of computed.
    fn admit_new(&mut self, id: u64) -> Option<Vec<SeqKey>> {
        let bs = self.blocks.block_size();
        let running = self.running_completions();
        let g = self.groups.get_mut(&id).expect("queued request exists");
        let live: Vec<usize> = g.unfinished().collect();
        let (prompt_len, n) = (g.prompt_len(), live.len());
        if running + n > self.cfg.max_num_seqs {
            return None;
        }
        let hashes = match (self.cfg.prefix_caching && g.may_reuse_cache(), live.first()) {
            (true, Some(&first)) => {
                // Kept on the first live completion, so a request waiting at the head of the
                // queue hashes its prompt once, not at every step it does not fit.
                let kept = &mut g.completions[first].hashes;
                self.hasher.extend(kept, &g.req.prompt_tokens, reusable_blocks(prompt_len, bs) * bs, bs);
                kept.clone()
            }
            _ => Vec::new(),
        };
        let found = self.blocks.probe(&hashes);
        let shared = shared_prefix_len(prompt_len, n, bs, self.cfg.fork_blocks);
        let needed = blocks_to_admit(prompt_len, n, bs, self.cfg.fork_blocks) - found.blocks;
        if needed > self.blocks.free_blocks() - found.evictable {
            return None;
        }
        let cached = found.blocks * bs;
        g.cached_tokens = cached;
        self.admitted.push((id, cached));
        if self.cfg.prefix_caching {
            self.prefix_stats.queries += prompt_len as u64;
            self.prefix_stats.hits += cached as u64;
        }
        let mut table = self.blocks.lookup(&hashes[..found.blocks]);
        let mut keys = Vec::with_capacity(n + 1);
        // Where the completions start: after the shared prefix, or after the cached blocks.
        let start = if cached < shared {
            // Part of the shared prefix is missing: one sequence computes it for all of them.
            table.reserve(shared).expect("free blocks checked");
            let tokens = g.req.prompt_tokens[..shared].to_vec();
            let mut prefix = Seq::new(tokens, table, SeqState::Running);
            (prefix.computed, prefix.registered, prefix.hashes) = (cached, found.blocks, hashes.clone());
            g.prefix = Some(prefix);
            keys.push(SeqKey { request: id, slot: Slot::Prefix });
            shared
        } else {
            for &i in &live {
                g.completions[i].table = table.share_prefix(found.blocks);
            }
            cached
        };
        let prefix_table = g.prefix.as_ref().map(|p| &p.table);
        for &i in &live {
            let c = &mut g.completions[i];
            if let Some(t) = prefix_table {
                c.table = t.share_prefix(start / bs);
                // The block the shared part ends in, when it ends inside one: kept alive for the
                // completion's fork (`BlockFork`) until that step is applied.
                c.fork_from = (start % bs != 0).then(|| t.share_range(start / bs..start / bs + 1));
            }
            (c.computed, c.registered, c.hashes) = (start, start / bs, hashes.clone());
            c.table.reserve(prompt_len).expect("free blocks checked");
            c.state = SeqState::Running;
            keys.push(SeqKey { request: id, slot: Slot::Completion(i) });
        }
        self.running.extend(&keys);
        Some(keys)
    }

    /// A preempted completion comes back alone: it recomputes its history into fresh blocks,
    /// except the leading blocks the prefix cache still holds (its own, kept after preemption,
    /// or anyone's with the same content).
    fn admit_resume(&mut self, key: SeqKey) -> bool {
        if self.running_completions() >= self.cfg.max_num_seqs {
            return false;
        }
        let bs = self.blocks.block_size();
        let g = self.groups.get_mut(&key.request).expect("queued sequence exists");
        let may_reuse = self.cfg.prefix_caching && g.may_reuse_cache();
        let seq = g.seq_mut(key.slot).expect("queued sequence exists");
        let len = seq.tokens.len();
        let reusable = if may_reuse { reusable_blocks(len, bs) } else { 0 };
        self.hasher.extend(&mut seq.hashes, &seq.tokens, reusable * bs, bs);
        let hashes = &seq.hashes[..reusable.min(seq.hashes.len())];
        let found = self.blocks.probe(hashes);
        if len.div_ceil(bs) - found.blocks > self.blocks.free_blocks() - found.evictable {
            return false;
        }
        seq.table = self.blocks.lookup(&hashes[..found.blocks]);
        seq.table.reserve(len).expect("free blocks checked");
        (seq.computed, seq.registered) = (found.blocks * bs, found.blocks);
        seq.state = SeqState::Running;
        self.running.push(key);
        true
    }

    /// Frees the newest resident sequence's blocks (`preempt`).
    pub(super) fn preempt_newest(&mut self) -> Option<SeqKey> {
        let key = *self.running.last()?;
        self.preempt(key);
        Some(key)
    }

    /// Frees a resident sequence's blocks. A completion goes to the front of the resume queue
    /// (preempting newest first, the oldest preempted sequence ends up first); a prefix is
    /// dropped, which only happens after all completions that share it were preempted, as they
    /// are newer.
    pub(super) fn preempt(&mut self, key: SeqKey) {
        self.running.retain(|&k| k != key);
        let g = self.groups.get_mut(&key.request).expect("running sequence exists");
        match key.slot {
            Slot::Prefix => g.prefix = None,
            Slot::Completion(i) => {
                let seq = &mut g.completions[i];
                seq.evict();
                seq.state = SeqState::Waiting;
                self.resume_queue.push_front(key);
                self.preemptions += 1;
            }
        }
    }
}
