//! Waiting for the ranks of a step without ever waiting forever: each participant (a local rank
//! thread, or a remote node standing for its ranks) is polled in turn; once one fails, the others
//! get `PEER_GRACE` to fail too (they usually do: their collective broke), then every rank's
//! collectives are aborted; a step older than the watchdog is aborted the same way.

use crate::runtime::step_thread::{StepRunner, StepThread, ThreadDied};
use crate::step::plan::StepOutput;
use std::time::{Duration, Instant};

/// How long the other ranks get to fail on their own after one failed, before the abort.
const PEER_GRACE: Duration = Duration::from_secs(2);
/// How long ranks get to return once their collectives were aborted.
const ABORT_GRACE: Duration = Duration::from_secs(5);

/// Why a participant's step failed. `died` marks a participant that went away by itself (a
/// panicked rank thread, a lost node): when one rank dies, its peers fail too (a broken
/// collective, or on NVLink an illegal address once the dead rank's buffers are freed), and the
/// error must name the death first, not whichever peer happened to be polled first.
#[derive(Debug)]
pub(crate) struct Failure {
    pub why: String,
    pub died: bool,
}

impl Failure {
    pub fn failed(why: String) -> Self {
        Failure { why, died: false }
    }
    pub fn died(why: String) -> Self {
        Failure { why, died: true }
    }
}

/// Something that answers for some ranks of a step.
pub(crate) trait Participant {
    /// "rank 3", "node 1" (error messages).
    fn name(&self) -> String;
    /// The outputs of its ranks (rank order) once in; `None` when not in by `deadline`.
    fn poll(&mut self, deadline: Instant) -> Option<Result<Vec<StepOutput>, Failure>>;
}

/// A local rank: its thread's answer.
pub(crate) struct LocalRank<'a, W: StepRunner<Output = StepOutput>> {
    pub rank: usize,
    pub thread: &'a mut StepThread<W>,
}

impl<W: StepRunner<Output = StepOutput>> Participant for LocalRank<'_, W> {
    fn name(&self) -> String {
        format!("rank {}", self.rank)
    }

    fn poll(&mut self, deadline: Instant) -> Option<Result<Vec<StepOutput>, Failure>> {
        self.thread
            .finish_step_until(Some(deadline))
            .map(|r| r.map(|o| vec![o]).map_err(|e| Failure { died: e.is::<ThreadDied>(), why: format!("{e:#}") }))
    }
}

/// Every participant's outputs, concatenated in order; on failure, what failed (every failing
/// participant named, the ones that died first, then the others in the order their failures were
/// seen: the cause before what it broke). `abort` is called at most once, when the group must be
/// stopped.
pub(crate) fn collect(
    parts: &mut [&mut dyn Participant],
    watchdog: Duration,
    abort: &dyn Fn(),
) -> Result<Vec<StepOutput>, String> {
    let started = Instant::now();
    let mut answers: Vec<Option<Result<Vec<StepOutput>, Failure>>> = parts.iter().map(|_| None).collect();
    // The order failures came in, by participant index.
    let mut failed_order: Vec<usize> = Vec::new();
    let mut first_failure: Option<Instant> = None;
    let mut aborted: Option<Instant> = None;
    let mut notes: Vec<String> = Vec::new();
    loop {
        let mut pending = 0;
        for (i, (p, answer)) in parts.iter_mut().zip(&mut answers).enumerate() {
            if answer.is_some() {
                continue;
            }
            // Wait on the first pending participant, look at the others in passing.
            let wait = if pending == 0 { Duration::from_millis(50) } else { Duration::ZERO };
            match p.poll(Instant::now() + wait) {
                Some(a) => {
                    if a.is_err() {
                        first_failure.get_or_insert_with(Instant::now);
                        failed_order.push(i);
                    }
                    *answer = Some(a);
                }
                None => pending += 1,
            }
        }
        if pending == 0 {
            break;
        }
        let overdue = started.elapsed() > watchdog;
        let peers_stuck = first_failure.is_some_and(|t| t.elapsed() > PEER_GRACE);
        match aborted {
            None if overdue || peers_stuck => {
                if overdue {
                    notes.push(format!(
                        "the step outlived the watchdog ({:.0} s, --watchdog-timeout)",
                        watchdog.as_secs_f64()
                    ));
                }
                abort();
                aborted = Some(Instant::now());
            }
            Some(t) if t.elapsed() > ABORT_GRACE => {
                let stuck: Vec<String> =
                    parts.iter().zip(&answers).filter(|(_, a)| a.is_none()).map(|(p, _)| p.name()).collect();
                notes.push(format!("{} did not return after the collectives were aborted", stuck.join(", ")));
                break;
            }
            _ => {}
        }
    }
    // Deaths first (a stable sort keeps the order seen within each kind).
    failed_order.sort_by_key(|&i| !matches!(&answers[i], Some(Err(f)) if f.died));
    let failures: Vec<String> = failed_order
        .iter()
        .filter_map(|&i| match &answers[i] {
            Some(Err(f)) => Some(format!("{}: {}", parts[i].name(), f.why)),
            _ => None,
        })
        .collect();
    if !failures.is_empty() || !notes.is_empty() {
        let mut why = failures.first().cloned().unwrap_or_default();
        if failures.len() > 1 {
            why += &format!("; after it: {}", failures[1..].join("; "));
        }
        for note in notes {
            why += &if why.is_empty() { note } else { format!("; {note}") };
        }
        return Err(why);
    }
    Ok(answers.into_iter().flat_map(|a| a.expect("every participant answered").expect("no failure")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers after `at` polls, with an error or with `n` outputs; never, if `at` is `None`.
    struct Scripted {
        polls: usize,
        at: Option<usize>,
        fail: bool,
        died: bool,
        name: &'static str,
    }

    fn scripted(at: Option<usize>, fail: bool) -> Scripted {
        Scripted { polls: 0, at, fail, died: false, name: "scripted" }
    }

    impl Participant for Scripted {
        fn name(&self) -> String {
            self.name.into()
        }
        fn poll(&mut self, deadline: Instant) -> Option<Result<Vec<StepOutput>, Failure>> {
            self.polls += 1;
            match self.at {
                Some(at) if self.polls >= at => Some(match (self.fail, self.died) {
                    (false, _) => Ok(vec![StepOutput::default()]),
                    (true, false) => Err(Failure::failed("boom".into())),
                    (true, true) => Err(Failure::died("it panicked".into())),
                }),
                _ => {
                    std::thread::sleep(
                        deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(5)),
                    );
                    None
                }
            }
        }
    }

    #[test]
    fn answers_are_concatenated_and_a_stuck_peer_is_aborted() {
        let (mut a, mut b) = (scripted(Some(3), false), scripted(Some(1), false));
        let aborts = std::cell::Cell::new(0);
        let out = collect(&mut [&mut a, &mut b], Duration::from_secs(5), &|| aborts.set(aborts.get() + 1)).unwrap();
        assert_eq!((out.len(), aborts.get()), (2, 0));

        // One fails, the other never answers: abort after the grace, then give up naming both.
        let (mut a, mut b) = (scripted(Some(1), true), scripted(None, false));
        let t = Instant::now();
        let e = collect(&mut [&mut a, &mut b], Duration::from_secs(60), &|| aborts.set(aborts.get() + 1)).unwrap_err();
        assert!(e.contains("scripted: boom") && e.contains("did not return"), "{e}");
        assert_eq!(aborts.get(), 1);
        assert!(t.elapsed() < PEER_GRACE + ABORT_GRACE + Duration::from_secs(2));

        // Nobody fails but a step hangs: the watchdog aborts it.
        let mut c = scripted(None, false);
        let e = collect(&mut [&mut c], Duration::from_millis(100), &|| {}).unwrap_err();
        assert!(e.contains("watchdog"), "{e}");
    }

    #[test]
    fn a_rank_that_died_is_named_before_the_peers_it_broke() {
        // Rank 0 is polled first and fails first (its collective read a dead peer's memory);
        // rank 1 died. The error names rank 1 as the cause.
        let mut r0 = Scripted { name: "rank 0", ..scripted(Some(1), true) };
        let mut r1 = Scripted { name: "rank 1", died: true, ..scripted(Some(2), true) };
        let mut r2 = Scripted { name: "rank 2", ..scripted(Some(3), true) };
        let e = collect(&mut [&mut r0, &mut r1, &mut r2], Duration::from_secs(60), &|| {}).unwrap_err();
        assert_eq!(e, "rank 1: it panicked; after it: rank 0: boom; rank 2: boom");
    }
}
