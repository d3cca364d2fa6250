//! Fair shares of the batch between owners (see the policy in `scheduler`): which waiting
//! sequence is considered next, and who makes room for it.

use super::Scheduler;
use crate::sequence::{Owner, SeqKey, Slot};
use std::collections::{HashMap, HashSet};

/// What admission considers next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Candidate {
    /// The preempted completion at the front of the resume queue.
    Resume(SeqKey),
    /// The new request at `position` in the new queue.
    New { id: u64, position: usize },
}

impl Scheduler {
    /// Resident completions per owner.
    fn resident_by_owner(&self) -> HashMap<Owner, usize> {
        let mut resident = HashMap::new();
        for key in self.running.iter().filter(|k| k.slot != Slot::Prefix) {
            *resident.entry(self.groups[&key.request].owner).or_insert(0) += 1;
        }
        resident
    }

    /// The preempted completion first, as before, unless a new request's owner holds fewer
    /// resident completions; among new requests the first of the owners holding the fewest.
    pub(super) fn next_candidate(&self) -> Option<Candidate> {
        let resume = self.resume_queue.front().copied();
        let &front = match self.new_queue.front() {
            Some(front) => front,
            None => return resume.map(Candidate::Resume),
        };
        // The usual case: the front request is its own owner, so it holds nothing yet, and no
        // preempted completion waits. No counting needed.
        if resume.is_none() && matches!(self.groups[&front].owner, Owner::Request(_)) {
            return Some(Candidate::New { id: front, position: 0 });
        }
        let resident = self.resident_by_owner();
        let holds = |id: u64| resident.get(&self.groups[&id].owner).copied().unwrap_or(0);
        let mut best = (usize::MAX, 0);
        for (position, &id) in self.new_queue.iter().enumerate() {
            let held = holds(id);
            if held < best.0 {
                best = (held, position);
            }
            if held == 0 {
                break;
            }
        }
        let (held, position) = best;
        match resume {
            Some(key) if holds(key.request) <= held => Some(Candidate::Resume(key)),
            _ => Some(Candidate::New { id: self.new_queue[position], position }),
        }
    }

    /// Makes room for `candidate`, which did not fit, when its owner stays within its fair
    /// share by being admitted: the owner holding the most completions above its own share
    /// gives up its newest one that is only decoding (one that still needs prefill may be in
    /// the step being built). Returns whether a completion was preempted.
    pub(super) fn preempt_for_fairness(&mut self, candidate: Candidate) -> bool {
        let (id, wants) = match candidate {
            Candidate::Resume(key) => (key.request, 1),
            Candidate::New { id, .. } => (id, self.groups[&id].unfinished().count()),
        };
        let resident = self.resident_by_owner();
        // A share is at least one completion: when nobody holds more (independent one-choice
        // requests, the usual case), nobody can be above it; skip counting the owners.
        if resident.values().all(|&held| held <= 1) {
            return false;
        }
        let owners: HashSet<Owner> = self.groups.values().map(|g| g.owner).collect();
        let share = (self.cfg.max_num_seqs / owners.len()).max(1);
        let owner = self.groups[&id].owner;
        if resident.get(&owner).copied().unwrap_or(0) + wants > share {
            return false;
        }
        let over = resident.into_iter().filter(|&(_, held)| held > share).max_by_key(|&(o, held)| (held, o));
        let Some((victim_owner, _)) = over else { return false };
        let victim = self.running.iter().rev().copied().find(|&k| {
            matches!(k.slot, Slot::Completion(_))
                && self.groups[&k.request].owner == victim_owner
                && self.is_decodable(k)
        });
        let Some(victim) = victim else { return false };
        self.preempt(victim);
        // Behind the candidate, which may itself be a preempted completion at the front.
        let front = self.resume_queue.pop_front().expect("just preempted");
        self.resume_queue.push_back(front);
        true
    }
}
