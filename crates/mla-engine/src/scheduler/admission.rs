//! Admission into the cache and preemption out of it.

use super::Scheduler;
use crate::sequence::{Seq, SeqKey, SeqState, Slot};

/// Prompt tokens the completions of an `n`-way request share: the full blocks before the block
/// that holds the last prompt token. Each completion recomputes from there, so its first sample
/// comes from its own prefill chunk and it never writes into a shared block.
pub fn shared_prefix_len(prompt_len: usize, n: usize, block_size: usize) -> usize {
    if n < 2 || prompt_len == 0 {
        return 0;
    }
    (prompt_len - 1) / block_size * block_size
}

/// Blocks a new request reserves when admitted: the shared prefix once, plus each completion's
/// own blocks for the rest of the prompt.
pub fn blocks_to_admit(prompt_len: usize, n: usize, block_size: usize) -> usize {
    let shared = shared_prefix_len(prompt_len, n, block_size) / block_size;
    shared + n * (prompt_len.div_ceil(block_size) - shared)
}

impl Scheduler {
    pub(super) fn running_completions(&self) -> usize {
        self.running.iter().filter(|k| k.slot != Slot::Prefix).count()
    }

    /// Admits the head of the queues (preempted sequences before new requests) if it fits
    /// within `max_num_seqs` and the free blocks; returns the keys that became resident.
    pub(super) fn admit_next(&mut self) -> Option<Vec<SeqKey>> {
        if let Some(&key) = self.resume_queue.front() {
            let ok = self.admit_resume(key);
            if ok {
                self.resume_queue.pop_front();
            }
            return ok.then(|| vec![key]);
        }
        let &id = self.new_queue.front()?;
        let keys = self.admit_new(id)?;
        self.new_queue.pop_front();
        Some(keys)
    }

    /// Admits a new request's completions, leaving out any the caller finished while it waited
    /// (they need no blocks, and a lone survivor needs no shared prefix).
    fn admit_new(&mut self, id: u64) -> Option<Vec<SeqKey>> {
        let bs = self.blocks.block_size();
        let running = self.running_completions();
        let g = self.groups.get_mut(&id).expect("queued request exists");
        let live: Vec<usize> = g.unfinished().collect();
        let (prompt_len, n) = (g.prompt_len(), live.len());
        if running + n > self.cfg.max_num_seqs || blocks_to_admit(prompt_len, n, bs) > self.blocks.free_blocks() {
            return None;
        }
        let shared = shared_prefix_len(prompt_len, n, bs);
        let mut keys = Vec::with_capacity(n + 1);
        if shared > 0 {
            let mut table = self.blocks.new_table();
            table.reserve(shared).expect("free blocks checked");
            for &i in &live {
                let c = &mut g.completions[i];
                c.table = table.share_prefix(shared / bs);
                c.computed = shared;
            }
            let tokens = g.req.prompt_tokens[..shared].to_vec();
            g.prefix = Some(Seq { tokens, computed: 0, table, state: SeqState::Running });
            keys.push(SeqKey { request: id, slot: Slot::Prefix });
        }
        for i in live {
            let c = &mut g.completions[i];
            c.table.reserve(prompt_len).expect("free blocks checked");
            c.state = SeqState::Running;
            keys.push(SeqKey { request: id, slot: Slot::Completion(i) });
        }
        self.running.extend(&keys);
        Some(keys)
    }

    /// A preempted completion comes back alone: it recomputes its whole history into fresh
    /// blocks (sharing again would need the prefix to still be resident, which it rarely is).
    fn admit_resume(&mut self, key: SeqKey) -> bool {
        if self.running_completions() >= self.cfg.max_num_seqs {
            return false;
        }
        let free = self.blocks.free_blocks();
        let seq = self.groups.get_mut(&key.request).and_then(|g| g.seq_mut(key.slot)).expect("queued sequence exists");
        if seq.table.missing_blocks(seq.tokens.len()) > free {
            return false;
        }
        seq.table.reserve(seq.tokens.len()).expect("free blocks checked");
        seq.computed = 0;
        seq.state = SeqState::Running;
        self.running.push(key);
        true
    }

    /// Frees the newest resident sequence's blocks. A completion goes to the front of the
    /// resume queue (the oldest preempted sequence ends up first); a prefix is dropped, which
    /// only happens after all completions that share it were preempted, as they are newer.
    pub(super) fn preempt_newest(&mut self) -> Option<SeqKey> {
        let key = self.running.pop()?;
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
        Some(key)
    }
}
