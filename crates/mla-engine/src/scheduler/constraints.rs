//! Structured output in the scheduler: each draw of a constrained completion gets an empty mask
//! slot when its plan is built, and the engine fills the slots (`fill_masks`) while the backend
//! runs the step's forward pass, so grammar work overlaps device work instead of sitting between
//! steps.

use super::Scheduler;
use crate::api::{TokenConstraint, MASK_BUDGET};
use crate::sequence::{SeqKey, Slot};
use mla_core::step::token_mask::{mask_words, MaskWriter, TokenMask};
use mla_core::StepPlan;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

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

    /// Computes the masks of the plan last built, using up to `threads` threads. Called after
    /// the step has started. A constraint that fails (its deadline passed, it allows no token,
    /// it panicked) gets a mask allowing every token, so the step samples as usual, and is
    /// reported with its request: the engine fails that request alone and drops its token.
    pub fn fill_masks(&mut self, vocab_size: usize, threads: usize) -> FilledMasks {
        if self.mask_jobs.is_empty() {
            return FilledMasks::default();
        }
        let mut writers: HashMap<SeqKey, MaskWriter> = self.mask_jobs.drain(..).collect();
        let mut work: Vec<Job> = Vec::with_capacity(writers.len());
        for (&request, g) in self.groups.iter_mut() {
            for (i, c) in g.constraints.0.iter_mut().enumerate() {
                if let Some(w) = writers.remove(&SeqKey { request, slot: Slot::Completion(i) }) {
                    work.push(Job { request, constraint: c, writer: w });
                }
            }
        }
        let words = mask_words(vocab_size);
        let run = |chunk: &mut [Job]| -> Vec<(u64, String)> {
            let mut failed = vec![];
            for job in chunk.iter_mut() {
                // `fill` consumes the writer; a spent one takes its place (its drop does nothing).
                let writer = std::mem::replace(&mut job.writer, MaskWriter::spent());
                let mut mask = vec![0u32; words];
                let deadline = Instant::now() + MASK_BUDGET;
                let result = catch_unwind(AssertUnwindSafe(|| job.constraint.fill_mask(&mut mask, deadline)))
                    .unwrap_or_else(
                        |_| Err("the structured-output constraint panicked computing its token mask".into()),
                    )
                    .and_then(|()| match mask.iter().any(|&w| w != 0) {
                        true => Ok(()),
                        false => Err("the structured-output grammar allows no token here".into()),
                    });
                match result {
                    Ok(()) => writer.fill(mask),
                    Err(why) => {
                        writer.fill(vec![u32::MAX; words]);
                        failed.push((job.request, why));
                    }
                }
            }
            failed
        };
        let (count, threads) = (work.len(), threads.clamp(1, work.len()));
        if count < PARALLEL_FROM || threads == 1 {
            let failed = run(&mut work);
            return FilledMasks { count, failed };
        }
        let per = count.div_ceil(threads);
        let failed = std::thread::scope(|scope| {
            let handles: Vec<_> = work.chunks_mut(per).map(|chunk| scope.spawn(|| run(chunk))).collect();
            handles.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect()
        });
        FilledMasks { count, failed }
    }
}

/// One draw's mask to compute.
struct Job<'a> {
    request: u64,
    constraint: &'a mut Box<dyn TokenConstraint>,
    writer: MaskWriter,
}

/// What `Scheduler::fill_masks` did.
#[derive(Debug, Default)]
pub struct FilledMasks {
    /// Masks computed (failed ones included).
    pub count: usize,
    /// Requests whose constraint failed, with why: the engine fails them. A request with several
    /// failed completions is listed once per completion.
    pub failed: Vec<(u64, String)>,
}
