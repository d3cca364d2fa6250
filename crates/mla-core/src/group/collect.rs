//! Waiting for the ranks of a step without ever waiting forever: each participant (a local rank
//! thread, or a remote node standing for its ranks) is polled in turn; once one fails, the others
//! get `PEER_GRACE` to fail too (they usually do: their collective broke), then every rank's
//! collectives are aborted; a step older than the watchdog is aborted the same way.

use crate::plan::StepOutput;
use crate::step_thread::{StepRunner, StepThread};
use std::time::{Duration, Instant};

/// How long the other ranks get to fail on their own after one failed, before the abort.
const PEER_GRACE: Duration = Duration::from_secs(2);
/// How long ranks get to return once their collectives were aborted.
const ABORT_GRACE: Duration = Duration::from_secs(5);

/// Something that answers for some ranks of a step.
pub(crate) trait Participant {
    /// "rank 3", "node 1" (error messages).
    fn name(&self) -> String;
    /// The outputs of its ranks (rank order) once in; `None` when not in by `deadline`.
    fn poll(&mut self, deadline: Instant) -> Option<Result<Vec<StepOutput>, String>>;
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

    fn poll(&mut self, deadline: Instant) -> Option<Result<Vec<StepOutput>, String>> {
        self.thread.finish_step_until(Some(deadline)).map(|r| r.map(|o| vec![o]).map_err(|e| format!("{e:#}")))
    }
}

/// Every participant's outputs, concatenated in order; on failure, what failed (every failing
/// participant named: the one that died and the ones its death broke). `abort` is called at most
/// once, when the group must be stopped.
pub(crate) fn collect(
    parts: &mut [&mut dyn Participant],
    watchdog: Duration,
    abort: &dyn Fn(),
) -> Result<Vec<StepOutput>, String> {
    let started = Instant::now();
    let mut answers: Vec<Option<Result<Vec<StepOutput>, String>>> = parts.iter().map(|_| None).collect();
    let mut first_failure: Option<Instant> = None;
    let mut aborted: Option<Instant> = None;
    let mut notes: Vec<String> = Vec::new();
    loop {
        let mut pending = 0;
        for (p, answer) in parts.iter_mut().zip(&mut answers) {
            if answer.is_some() {
                continue;
            }
            // Wait on the first pending participant, look at the others in passing.
            let wait = if pending == 0 { Duration::from_millis(50) } else { Duration::ZERO };
            match p.poll(Instant::now() + wait) {
                Some(a) => {
                    if a.is_err() {
                        first_failure.get_or_insert_with(Instant::now);
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
    let mut failures: Vec<String> = parts
        .iter()
        .zip(&answers)
        .filter_map(|(p, a)| match a {
            Some(Err(e)) => Some(format!("{}: {e}", p.name())),
            _ => None,
        })
        .collect();
    failures.extend(notes);
    if !failures.is_empty() {
        return Err(failures.join("; "));
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
    }

    impl Participant for Scripted {
        fn name(&self) -> String {
            "scripted".into()
        }
        fn poll(&mut self, deadline: Instant) -> Option<Result<Vec<StepOutput>, String>> {
            self.polls += 1;
            match self.at {
                Some(at) if self.polls >= at => {
                    Some(if self.fail { Err("boom".into()) } else { Ok(vec![StepOutput::default()]) })
                }
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
        let (mut a, mut b) =
            (Scripted { polls: 0, at: Some(3), fail: false }, Scripted { polls: 0, at: Some(1), fail: false });
        let aborts = std::cell::Cell::new(0);
        let out = collect(&mut [&mut a, &mut b], Duration::from_secs(5), &|| aborts.set(aborts.get() + 1)).unwrap();
        assert_eq!((out.len(), aborts.get()), (2, 0));

        // One fails, the other never answers: abort after the grace, then give up naming both.
        let (mut a, mut b) =
            (Scripted { polls: 0, at: Some(1), fail: true }, Scripted { polls: 0, at: None, fail: false });
        let t = Instant::now();
        let e = collect(&mut [&mut a, &mut b], Duration::from_secs(60), &|| aborts.set(aborts.get() + 1)).unwrap_err();
        assert!(e.contains("scripted: boom") && e.contains("did not return"), "{e}");
        assert_eq!(aborts.get(), 1);
        assert!(t.elapsed() < PEER_GRACE + ABORT_GRACE + Duration::from_secs(2));

        // Nobody fails but a step hangs: the watchdog aborts it.
        let mut c = Scripted { polls: 0, at: None, fail: false };
        let e = collect(&mut [&mut c], Duration::from_millis(100), &|| {}).unwrap_err();
        assert!(e.contains("watchdog"), "{e}");
    }
}
