//! What a rank keeps of its sampled drafts from the step that draws them to the step that
//! verifies them (`speculative`): each drafting sequence's MTP logits rows, on the device, in a
//! slot of `drafts` rows, with the drafts drawn from them; and the device room the verdict
//! launches (`ops::Verdicts`) take their rows and sequences from.
//!
//! A draft is verified against its own distribution only while the slot still holds the rows it
//! was drawn from: a sequence absent from a step gives its slot up, one that stops drafting too,
//! and a slot being rewritten forgets its drafts until the step that rewrites it finishes (a step
//! that fails half-way leaves nothing that could pair drafts with rows of other draws). Drafts
//! without their rows are verified against their point masses, which is exact, only accepted
//! less (`mla_core::speculative::point_mass`); so is a sequence for which no slot was free.

use crate::gpu::{DSlice, DeviceBuffer};
use crate::ops::{SpecRowRaw, SpecVerdictRaw, ROW_DISTRIBUTION_BYTES};
use mla_core::step::plan::StepPlan;
use std::collections::{HashMap, HashSet};

pub struct DraftStore {
    /// `[slots * drafts, vocab]`: slot `s` holds rows `s * drafts ..`, draft `j` in row `j`.
    rows: DeviceBuffer<f32>,
    vocab: usize,
    pub slots: Slots,
    /// Room for one verify step's verdict launch and one MTP pass's row copies.
    pub spec_rows: DeviceBuffer<SpecRowRaw>,
    pub dists: DeviceBuffer<u8>,
    pub verdicts: DeviceBuffer<SpecVerdictRaw>,
    pub pairs: DeviceBuffer<i32>,
}

impl DraftStore {
    /// Room for `rows` drafts' rows of `vocab` logits, `drafts` per sequence, and for verdicts
    /// over up to `rows` sequences (a step's rows bound its drafting sequences).
    pub fn new(rows: usize, drafts: usize, vocab: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(drafts > 0, "a draft store for no drafts");
        let slots = rows / drafts;
        Ok(DraftStore {
            rows: DeviceBuffer::alloc(slots * drafts * vocab)?,
            vocab,
            slots: Slots::new(slots, drafts),
            spec_rows: DeviceBuffer::alloc(2 * rows)?,
            dists: DeviceBuffer::alloc(2 * rows * ROW_DISTRIBUTION_BYTES)?,
            verdicts: DeviceBuffer::alloc(rows)?,
            pairs: DeviceBuffer::alloc(2 * rows)?,
        })
    }

    /// Device address of the rows sequence `seq_id`'s drafts `fed` were drawn from, if the store
    /// still holds them.
    pub fn rows_of(&self, seq_id: u64, fed: &[u32]) -> Option<u64> {
        let row = self.slots.first_row_of(seq_id, fed)?;
        Some(self.rows.ptr() + (row * self.vocab * std::mem::size_of::<f32>()) as u64)
    }

    pub fn rows(&self) -> DSlice<'_, f32> {
        self.rows.slice()
    }
}

/// Which sequence holds which slot, and the drafts its rows were drawn for.
#[derive(Debug)]
pub struct Slots {
    drafts: usize,
    /// By sequence: its slot, and its drafts (empty while the slot is rewritten).
    held: HashMap<u64, (usize, Vec<u32>)>,
    free: Vec<usize>,
}

impl Slots {
    fn new(slots: usize, drafts: usize) -> Self {
        Slots { drafts, held: HashMap::new(), free: (0..slots).rev().collect() }
    }

    /// Gives up the slots of sequences `plan` does not run: nothing verifies their drafts now.
    pub fn keep_only(&mut self, plan: &StepPlan) {
        let running: HashSet<u64> = plan.seqs.iter().map(|s| s.seq_id).collect();
        let free = &mut self.free;
        self.held.retain(|id, (slot, _)| {
            let stays = running.contains(id);
            if !stays {
                free.push(*slot);
            }
            stays
        });
    }

    /// The first row of the slot holding the rows `seq_id`'s drafts `fed` were drawn from.
    fn first_row_of(&self, seq_id: u64, fed: &[u32]) -> Option<usize> {
        let (slot, drafts) = self.held.get(&seq_id)?;
        (!fed.is_empty() && drafts.get(..fed.len()) == Some(fed)).then_some(slot * self.drafts)
    }

    /// The row for draft `j` of `seq_id`, drawing now: in the slot it holds or a free one
    /// (`None` when none is free). The slot forgets its drafts until `finish`.
    pub fn row_for(&mut self, seq_id: u64, j: usize) -> Option<usize> {
        assert!(j < self.drafts, "draft {j} of a store for {} per sequence", self.drafts);
        let (slot, drafts) = match self.held.get_mut(&seq_id) {
            Some(h) => h,
            None => {
                let slot = self.free.pop()?;
                self.held.entry(seq_id).or_insert((slot, vec![]))
            }
        };
        drafts.clear();
        Some(*slot * self.drafts + j)
    }

    /// After a step's MTP passes: `drafted` names each sampled sequence whose draws were kept
    /// (`row_for`) with its drafts; every other sequence of `plan` gives its slot up.
    pub fn finish(&mut self, plan: &StepPlan, drafted: &[(u64, Vec<u32>)]) {
        let drafted: HashMap<u64, &Vec<u32>> = drafted.iter().map(|(id, d)| (*id, d)).collect();
        for s in &plan.seqs {
            match drafted.get(&s.seq_id) {
                Some(d) => {
                    if let Some((_, drafts)) = self.held.get_mut(&s.seq_id) {
                        drafts.clone_from(*d);
                    }
                }
                None => {
                    if let Some((slot, _)) = self.held.remove(&s.seq_id) {
                        self.free.push(slot);
                    }
                }
            }
        }
    }

    /// Forgets every sequence's drafts (after a failed step: what the rows hold is unknown).
    pub fn forget(&mut self) {
        self.free.extend(self.held.drain().map(|(_, (slot, _))| slot));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mla_core::step::plan::{LogitsRequest, SeqStep, StepKind};

    fn plan(ids: &[u64]) -> StepPlan {
        let seq = |&seq_id: &u64| SeqStep {
            fork: None,
            seq_id,
            tokens: vec![1],
            context_len: 4,
            block_table: vec![0],
            logits: LogitsRequest::None,
            sample: None,
            mtp: None,
        };
        StepPlan { kind: StepKind::Decode, seqs: ids.iter().map(seq).collect() }
    }

    #[test]
    fn drafts_find_their_rows_until_the_slot_is_given_up_or_rewritten() {
        let mut s = Slots::new(2, 3);
        // Sequence 7 draws two drafts into its slot, 8 one.
        assert_eq!((s.row_for(7, 0), s.row_for(7, 1), s.row_for(8, 0)), (Some(0), Some(1), Some(3)));
        // A third sequence finds no slot: its drafts go unkept.
        assert_eq!(s.row_for(9, 0), None);
        s.finish(&plan(&[7, 8, 9]), &[(7, vec![40, 41]), (8, vec![50])]);
        assert_eq!(s.first_row_of(7, &[40, 41]), Some(0));
        assert_eq!(s.first_row_of(7, &[40]), Some(0), "a prefix of the drafts is fed");
        assert_eq!(s.first_row_of(7, &[41]), None, "other drafts than those drawn");
        assert_eq!(s.first_row_of(8, &[50]), Some(3));
        assert_eq!(s.first_row_of(9, &[60]), None);
        // Rewriting 7's slot forgets its drafts at once (a failed step must not pair them).
        assert_eq!(s.row_for(7, 0), Some(0));
        assert_eq!(s.first_row_of(7, &[40]), None);
        // A step without 8 gives its slot to the next sequence; one where 7 stops drafting too.
        s.keep_only(&plan(&[7, 9]));
        assert_eq!(s.row_for(9, 0), Some(3));
        s.finish(&plan(&[7, 9]), &[(9, vec![61])]);
        assert_eq!(s.first_row_of(7, &[40]), None);
        assert_eq!(s.row_for(10, 0), Some(0));
        // After a failure every slot is free and nothing matches.
        s.forget();
        assert_eq!(s.first_row_of(9, &[61]), None);
        assert_eq!(s.free.len(), 2);
    }
}
