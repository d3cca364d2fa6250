//! Structured output in the scheduler: each draw of a constrained completion gets an empty mask
//! slot when its plan is built, and the engine fills the slots (`fill_masks`) while the backend
//! runs the step's forward pass, so grammar work overlaps device work instead of sitting between
//! steps.

use super::Scheduler;
use crate::api::TokenConstraint;
use crate::sequence::{SeqKey, Slot};
use mla_core::token_mask::{mask_words, MaskWriter, TokenMask};
use mla_core::StepPlan;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Below this many masks one thread computes them all: starting threads costs more than it saves.
const PARALLEL_FROM: usize = 4;

impl Scheduler {
    /// Gives every draw of a constrained completion in `plan` a mask slot to be filled.
    pub(super) fn attach_masks(&mut self, plan: &mut StepPlan) {
        debug_assert!(self.mask_jobs.is_empty(), "masks of the previous plan were never filled");
        self.mask_jobs.clear();
        for s in &mut plan.seqs {
            let Some(sample) = s.sample.as_mut() else { continue };
            let key = SeqKey::from_seq_id(s.seq_id);
            if self.groups.get(&key.request).is_some_and(|g| !g.constraints.0.is_empty()) {
                let (mask, writer) = TokenMask::pending();
                sample.allowed = Some(mask);
                self.mask_jobs.push((key, writer));
            }
        }
    }

    /// Computes the masks of the plan last built, using up to `threads` threads, and returns
    /// how many. Called after the step has started; a constraint that panics leaves its writer
    /// dropped, which fails that draw (and so the step) instead of hanging it.
    pub fn fill_masks(&mut self, vocab_size: usize, threads: usize) -> usize {
        if self.mask_jobs.is_empty() {
            return 0;
        }
        let mut writers: HashMap<SeqKey, MaskWriter> = self.mask_jobs.drain(..).collect();
        let mut work: Vec<(&mut Box<dyn TokenConstraint>, MaskWriter)> = Vec::with_capacity(writers.len());
        for (&request, g) in self.groups.iter_mut() {
            for (i, c) in g.constraints.0.iter_mut().enumerate() {
                if let Some(w) = writers.remove(&SeqKey { request, slot: Slot::Completion(i) }) {
                    work.push((c, w));
                }
            }
        }
        let words = mask_words(vocab_size);
        let run = |chunk: &mut [(&mut Box<dyn TokenConstraint>, MaskWriter)]| {
            for (c, w) in chunk.iter_mut() {
                // `fill` consumes the writer; a spent one takes its place (its drop does nothing).
                let writer = std::mem::replace(w, MaskWriter::spent());
                let mut mask = vec![0u32; words];
                match catch_unwind(AssertUnwindSafe(|| c.fill_mask(&mut mask))) {
                    Ok(()) => writer.fill(mask),
                    // Dropping the writer fails this draw's step; the engine retries the
                    // requests one by one, so only this one fails.
                    Err(_) => tracing::error!("a structured-output constraint panicked computing its mask"),
                }
            }
        };
        let (count, threads) = (work.len(), threads.clamp(1, work.len()));
        if count < PARALLEL_FROM || threads == 1 {
            run(&mut work);
            return count;
        }
        let per = count.div_ceil(threads);
        std::thread::scope(|scope| {
            for chunk in work.chunks_mut(per) {
                scope.spawn(|| run(chunk));
            }
        });
        count
    }
}
