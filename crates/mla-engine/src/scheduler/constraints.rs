//! Structured output in the scheduler: each draw of a constrained completion gets an empty mask
//! slot when its plan is built, and the engine fills the slots (`fill_masks`) while the backend
//! runs the step's forward pass, so grammar work overlaps device work instead of sitting between
//! steps.
//!
//! A sequence verifying drafts draws once per verify row, row `j` after the drafts before it:
//! its slot holds a mask per row, the constraint followed along the drafts and rolled back
//! (`masks_along`), so every row is shaped as a draw without drafts would be. A draft the mask
//! before it forbids cannot stand (its probability under the masked row is 0), so the rows past
//! it are never read; they repeat the last mask computed. The step's sampler waits for every
//! mask, so the rows after row 0 are time the whole batch waits for one request's drafts: a
//! request whose rows after row 0 take longer than `SLOW_LOOKAHEAD` stops drafting, and its
//! masks cost what they cost without speculative decoding.

use super::Scheduler;
use crate::api::{TokenConstraint, MASK_BUDGET};
use crate::sequence::{SeqKey, Slot};
use mla_core::step::token_mask::{allows, mask_words, MaskWriter, TokenMask};
use mla_core::StepPlan;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// Below this many masks one thread computes them all: starting threads costs more than it saves.
const PARALLEL_FROM: usize = 4;

/// Longest a request's masks along its drafts (the rows after row 0) may take in one step before
/// it stops drafting: a fifth of the one mask's `MASK_BUDGET`. Ordinary grammars take
/// microseconds to a few milliseconds a mask; one near its budget would otherwise hold every
/// step up to `K + 1` budgets.
pub const SLOW_LOOKAHEAD: Duration = Duration::from_millis(10);

impl Scheduler {
    /// Gives every draw of a constrained completion in `plan` a mask slot to be filled.
    pub(super) fn attach_masks(&mut self, plan: &mut StepPlan) {
        debug_assert!(self.mask_jobs.is_empty(), "masks of the previous plan were never filled");
        self.mask_jobs.clear();
        for s in &mut plan.seqs {
            let drafts = s.tokens[s.tokens.len() - s.drafts_fed()..].to_vec();
            let Some(sample) = s.sample.as_mut() else { continue };
            let key = SeqKey::from_seq_id(s.seq_id);
            if self.groups.get(&key.request).is_some_and(|g| !g.constraints.0.is_empty()) {
                let (mask, writer) = TokenMask::pending_rows(drafts.len() + 1);
                sample.allowed = Some(mask);
                self.mask_jobs.push((key, MaskJob { writer, drafts }));
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
        let mut jobs: HashMap<SeqKey, MaskJob> = self.mask_jobs.drain(..).collect();
        let mut work: Vec<Job> = Vec::with_capacity(jobs.len());
        for (&request, g) in self.groups.iter_mut() {
            for (i, c) in g.constraints.0.iter_mut().enumerate() {
                if let Some(job) = jobs.remove(&SeqKey { request, slot: Slot::Completion(i) }) {
                    work.push(Job { request, constraint: c, job });
                }
            }
        }
        let words = mask_words(vocab_size);
        let run = |chunk: &mut [Job]| -> Outcomes {
            let mut out = Outcomes::default();
            for job in chunk.iter_mut() {
                // `fill` consumes the writer; a spent one takes its place (its drop does nothing).
                let writer = std::mem::replace(&mut job.job.writer, MaskWriter::spent());
                let (drafts, constraint) = (&job.job.drafts, &mut **job.constraint);
                let rows =
                    catch_unwind(AssertUnwindSafe(|| masks_along(constraint, drafts, words))).unwrap_or_else(|_| {
                        Err("the structured-output constraint panicked computing its token mask".into())
                    });
                match rows {
                    Ok((rows, lookahead)) => {
                        writer.fill(rows);
                        if lookahead > SLOW_LOOKAHEAD {
                            out.slow.push((job.request, lookahead));
                        }
                    }
                    Err(why) => {
                        writer.fill(vec![u32::MAX; words * (drafts.len() + 1)]);
                        out.failed.push((job.request, why));
                    }
                }
            }
            out
        };
        let (count, threads) = (work.len(), threads.clamp(1, work.len()));
        let out = if count < PARALLEL_FROM || threads == 1 {
            run(&mut work)
        } else {
            let per = count.div_ceil(threads);
            std::thread::scope(|scope| {
                let handles: Vec<_> = work.chunks_mut(per).map(|chunk| scope.spawn(|| run(chunk))).collect();
                handles.into_iter().fold(Outcomes::default(), |mut all, h| {
                    let o = h.join().unwrap_or_default();
                    all.failed.extend(o.failed);
                    all.slow.extend(o.slow);
                    all
                })
            })
        };
        for (request, took) in out.slow {
            let Some(g) = self.groups.get_mut(&request) else { continue };
            if !g.grammar_too_slow_to_draft {
                g.grammar_too_slow_to_draft = true;
                tracing::info!(
                    "request {request}: its grammar's masks along the drafts took {} ms (more than {} ms); it decodes one token per step from now on",
                    took.as_millis(),
                    SLOW_LOOKAHEAD.as_millis()
                );
            }
        }
        FilledMasks { count, failed: out.failed }
    }
}

/// What computing one chunk of the jobs gave: requests whose constraint failed, with why, and
/// requests whose masks along drafts were slow, with how long they took.
#[derive(Default)]
struct Outcomes {
    failed: Vec<(u64, String)>,
    slow: Vec<(u64, Duration)>,
}

/// The masks of one sequence's draws (a row per draft it verifies, and one).
pub(super) struct MaskJob {
    writer: MaskWriter,
    /// The drafts the sequence feeds after its last token (none without speculative decoding).
    drafts: Vec<u32>,
}

/// One sequence's masks to compute, with its constraint.
struct Job<'a> {
    request: u64,
    constraint: &'a mut Box<dyn TokenConstraint>,
    job: MaskJob,
}

/// The masks of a sequence's verify rows, end to end, `words` each: row 0 for the next draw,
/// row `j` after `drafts[..j]` (the constraint followed along them and rolled back after), and
/// how long the rows after row 0 took. Each mask has its own `MASK_BUDGET`. Past a draft the
/// mask before it forbids, rows repeat that mask: the draft cannot stand, so they are never
/// drawn from.
fn masks_along(c: &mut dyn TokenConstraint, drafts: &[u32], words: usize) -> Result<(Vec<u32>, Duration), String> {
    let mut rows = vec![0u32; words * (drafts.len() + 1)];
    fill_row(c, &mut rows[..words])?;
    let started = Instant::now();
    let mut followed = 0;
    let walked = follow_drafts(c, drafts, &mut rows, words, &mut followed);
    c.rollback(followed);
    walked?;
    for j in followed + 1..=drafts.len() {
        rows.copy_within(followed * words..(followed + 1) * words, j * words);
    }
    Ok((rows, started.elapsed()))
}

/// Fills the rows after row 0 while the drafts are allowed, counting those followed.
fn follow_drafts(
    c: &mut dyn TokenConstraint,
    drafts: &[u32],
    rows: &mut [u32],
    words: usize,
    followed: &mut usize,
) -> Result<(), String> {
    for &draft in drafts {
        let (done, rest) = rows.split_at_mut((*followed + 1) * words);
        if !allows(&done[*followed * words..], draft) {
            break;
        }
        c.follow(draft)?;
        *followed += 1;
        fill_row(c, &mut rest[..words])?;
    }
    Ok(())
}

/// One mask, within its own `MASK_BUDGET`; one that allows nothing is the grammar's failure.
fn fill_row(c: &mut dyn TokenConstraint, row: &mut [u32]) -> Result<(), String> {
    c.fill_mask(row, Instant::now() + MASK_BUDGET)?;
    match row.iter().any(|&w| w != 0) {
        true => Ok(()),
        false => Err("the structured-output grammar allows no token here".into()),
    }
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
