//! `StepThread`: the thread a device backend runs its steps on. A CUDA context is bound to the
//! thread that created it, so all device state is created on this thread and never leaves it;
//! steps and jobs reach it over a channel and their results come back the same way.

use crate::step::plan::{StepKind, StepPlan};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a `StepThread` runs: the device state, created on that thread and never leaving it.
pub trait StepRunner: 'static {
    /// What one step hands the thread (a backend's plans, or one rank's share of a group step).
    type Step: StepSize + Send + Sync + 'static;
    type Output: Send + 'static;
    fn run_step(&mut self, step: &Self::Step) -> anyhow::Result<Self::Output>;
}

/// The size of a step, so the caller can tell how long a step like it took last time.
pub trait StepSize {
    fn size(&self) -> StepShape;
}

impl StepSize for Vec<StepPlan> {
    fn size(&self) -> StepShape {
        StepShape {
            decode: self.iter().all(|p| p.kind == StepKind::Decode),
            seqs: self.iter().map(|p| p.seqs.len()).sum(),
            tokens: self.iter().map(|p| p.num_tokens()).sum(),
        }
    }
}

type Job<W> = Box<dyn FnOnce(&mut W) + Send>;

enum Msg<W: StepRunner> {
    Step(Arc<W::Step>),
    Job(Job<W>),
}

/// A thread whose state is being created.
struct Starting<W: StepRunner, R> {
    thread: StepThread<W>,
    ready: Receiver<anyhow::Result<R>>,
    name: String,
}

impl<W: StepRunner, R> Starting<W, R> {
    fn wait(self) -> anyhow::Result<(StepThread<W>, R)> {
        let name = self.name;
        let ready = self.ready.recv().map_err(|_| anyhow::anyhow!("thread {name} died while starting"))??;
        Ok((self.thread, ready))
    }
}

/// How long the step thread polls for the next step after finishing one before it blocks, and
/// how early the caller starts polling for a step's output. Waking a blocked thread costs tens
/// of microseconds on a server (futex wake, idle core leaving its sleep state), twice per step;
/// the device idles for all of it, so both sides poll around the hand-over instead.
const HANDOFF_SPIN: Duration = Duration::from_micros(1000);
/// Steps shorter than this are awaited by polling from the start.
const MIN_SLEEP: Duration = Duration::from_micros(200);

/// A step's thread ended without answering (it panicked): the rank itself failed, as opposed
/// to a rank whose step failed because a peer went away. Typed so that a group's error can name
/// the cause before the failures it set off.
#[derive(Debug)]
pub struct ThreadDied;

impl std::fmt::Display for ThreadDied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the backend's thread stopped during a step (it panicked)")
    }
}

impl std::error::Error for ThreadDied {}

/// A thread that owns a backend's device state `W` (a CUDA context is bound to the thread that
/// created it) and runs the steps and jobs handed to it, in order. `start_step` /
/// `finish_step` implement `Backend`'s asynchronous pair; `step` is both in one call.
///
/// The hand-over is tuned for the gap between two steps, when the device waits for the host:
/// after a step the thread polls for the next one for a while before it blocks, and
/// `finish_step` sleeps only until shortly before the step is expected to end (from the last
/// step of the same kind and size) and polls from there.
pub struct StepThread<W: StepRunner> {
    msgs: Option<Sender<Msg<W>>>,
    results: Receiver<anyhow::Result<W::Output>>,
    thread: Option<JoinHandle<()>>,
    in_flight: Option<InFlight>,
    /// The last step's duration as the caller saw it, by shape.
    last: Option<(StepShape, Duration)>,
}

struct InFlight {
    started: Instant,
    shape: StepShape,
    /// Why the step never started.
    error: Option<anyhow::Error>,
}

/// A step's kind and size: steps alike in these take alike times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    pub decode: bool,
    pub seqs: usize,
    pub tokens: usize,
}

impl<W: StepRunner> StepThread<W> {
    /// Spawns the thread, creates `W` on it with `init`, and returns once `init` has finished,
    /// with what `init` reported besides `W` (or its error).
    pub fn spawn<R, F>(name: String, init: F) -> anyhow::Result<(Self, R)>
    where
        R: Send + 'static,
        F: FnOnce() -> anyhow::Result<(W, R)> + Send + 'static,
    {
        Self::start(name, init)?.wait()
    }

    /// `spawn` for a group: starts every thread before waiting for any, since the states of a
    /// group's ranks may wait for each other while they are created (NCCL's communicator setup
    /// returns only once every rank has joined). Returns the threads in the order of `inits`, or
    /// the first failure in that order; threads that did start are stopped.
    pub fn spawn_group<R, F>(inits: Vec<(String, F)>) -> anyhow::Result<Vec<(Self, R)>>
    where
        R: Send + 'static,
        F: FnOnce() -> anyhow::Result<(W, R)> + Send + 'static,
    {
        let starting: Vec<Starting<W, R>> =
            inits.into_iter().map(|(name, init)| Self::start(name, init)).collect::<anyhow::Result<_>>()?;
        let mut started = Vec::with_capacity(starting.len());
        let mut first_error = None;
        for s in starting {
            match s.wait() {
                Ok(t) => started.push(t),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            // Dropping the started threads ends them.
            Some(e) => Err(e),
            None => Ok(started),
        }
    }

    fn start<R, F>(name: String, init: F) -> anyhow::Result<Starting<W, R>>
    where
        R: Send + 'static,
        F: FnOnce() -> anyhow::Result<(W, R)> + Send + 'static,
    {
        let (msgs_tx, msgs_rx) = mpsc::channel::<Msg<W>>();
        let (results_tx, results_rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel::<anyhow::Result<R>>();
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let mut w = match init() {
                    Ok((w, r)) => {
                        if ready_tx.send(Ok(r)).is_err() {
                            return;
                        }
                        w
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                serve(&mut w, &msgs_rx, &results_tx);
            })
            .map_err(|e| anyhow::anyhow!("spawning thread {name}: {e}"))?;
        let t =
            StepThread { msgs: Some(msgs_tx), results: results_rx, thread: Some(thread), in_flight: None, last: None };
        Ok(Starting { thread: t, ready: ready_rx, name })
    }

    fn send(&self, msg: Msg<W>) -> anyhow::Result<()> {
        self.msgs
            .as_ref()
            .expect("the channel lives as long as the thread")
            .send(msg)
            .map_err(|_| anyhow::anyhow!("the backend's thread has stopped"))
    }

    /// Hands `plan` to the thread; `finish_step` returns its output, or why it could not start
    /// (the thread is gone).
    ///
    /// Panics if a step is already in flight (its output would be taken for this one's).
    pub fn start_step(&mut self, step: &Arc<W::Step>) {
        assert!(self.in_flight.is_none(), "start_step while a step is in flight; call finish_step first");
        let sent = self.send(Msg::Step(step.clone()));
        self.in_flight = Some(InFlight { started: Instant::now(), shape: step.size(), error: sent.err() });
    }

    /// The output of the step in flight.
    pub fn finish_step(&mut self) -> anyhow::Result<W::Output> {
        self.finish_step_until(None).expect("without a deadline the wait ends with the output")
    }

    /// `finish_step`, giving up at `deadline` (`None`: never): then the step stays in flight
    /// and `None` is returned, so a caller watching several threads can check the others.
    pub fn finish_step_until(&mut self, deadline: Option<Instant>) -> Option<anyhow::Result<W::Output>> {
        let Some(f) = self.in_flight.as_mut() else {
            return Some(Err(anyhow::anyhow!("finish_step without a started step")));
        };
        if let Some(e) = f.error.take() {
            self.in_flight = None;
            return Some(Err(e));
        }
        let (started, shape) = (f.started, f.shape);
        let expected = self.last.filter(|(s, _)| *s == shape).map(|(_, d)| d);
        let out = self.wait(started, expected, deadline)?;
        self.in_flight = None;
        self.last = Some((shape, started.elapsed()));
        Some(out)
    }

    /// Ends the thread without waiting for it: the channel closes, and a thread stuck in a step
    /// (a device waiting for a dead peer) is left to the process's exit instead of hanging the
    /// caller in a join.
    pub fn detach(mut self) {
        self.msgs.take();
        self.thread.take();
    }

    fn wait(
        &self,
        started: Instant,
        expected: Option<Duration>,
        deadline: Option<Instant>,
    ) -> Option<anyhow::Result<W::Output>> {
        let died = || anyhow::Error::new(ThreadDied);
        let until = |t: Instant| deadline.map_or(t, |d| d.min(t));
        // Sleep through most of the step, then poll, then (a step far longer than the last) block.
        if let Some(sleep) = expected.and_then(|e| e.checked_sub(HANDOFF_SPIN)).filter(|&s| s >= MIN_SLEEP) {
            let left = until(started + sleep).saturating_duration_since(Instant::now());
            match self.results.recv_timeout(left) {
                Ok(r) => return Some(r),
                Err(RecvTimeoutError::Disconnected) => return Some(Err(died())),
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
        let poll_until = until(Instant::now() + 2 * HANDOFF_SPIN);
        loop {
            match self.results.try_recv() {
                Ok(r) => return Some(r),
                Err(TryRecvError::Disconnected) => return Some(Err(died())),
                Err(TryRecvError::Empty) if Instant::now() < poll_until => std::thread::yield_now(),
                Err(TryRecvError::Empty) => break,
            }
        }
        let r = match deadline {
            None => self.results.recv().map_err(|_| ()),
            Some(d) => match self.results.recv_timeout(d.saturating_duration_since(Instant::now())) {
                Ok(r) => Ok(r),
                Err(RecvTimeoutError::Timeout) => return None,
                Err(RecvTimeoutError::Disconnected) => Err(()),
            },
        };
        Some(r.unwrap_or_else(|()| Err(died())))
    }

    /// Runs one step and waits for it (`start_step` + `finish_step`).
    pub fn step(&mut self, step: W::Step) -> anyhow::Result<W::Output> {
        self.start_step(&Arc::new(step));
        self.finish_step()
    }

    /// Runs `f` on the thread with the device state (tests, benchmarks), after any step in
    /// flight.
    pub fn with<R, F>(&self, f: F) -> anyhow::Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut W) -> R + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        self.send(Msg::Job(Box::new(move |w| {
            let _ = tx.send(f(w));
        })))?;
        rx.recv().map_err(|_| anyhow::anyhow!("the backend's thread stopped during a job (it panicked)"))
    }
}

/// The thread's loop: steps and jobs in order, polling for a while after each step.
fn serve<W: StepRunner>(w: &mut W, msgs: &Receiver<Msg<W>>, results: &Sender<anyhow::Result<W::Output>>) {
    let mut poll = false;
    loop {
        let msg = if poll { next_polling(msgs) } else { msgs.recv().ok() };
        let Some(msg) = msg else { return };
        poll = match msg {
            Msg::Step(step) => {
                let out = w.run_step(&step);
                // The caller may reuse the step's buffers once it has the output.
                drop(step);
                if results.send(out).is_err() {
                    return;
                }
                true
            }
            Msg::Job(job) => {
                job(w);
                false
            }
        };
    }
}

fn next_polling<W: StepRunner>(msgs: &Receiver<Msg<W>>) -> Option<Msg<W>> {
    let until = Instant::now() + HANDOFF_SPIN;
    while Instant::now() < until {
        match msgs.try_recv() {
            Ok(m) => return Some(m),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => std::thread::yield_now(),
        }
    }
    msgs.recv().ok()
}

impl<W: StepRunner> Drop for StepThread<W> {
    fn drop(&mut self) {
        // Closing the channel ends the loop; `W` is dropped on its own thread.
        self.msgs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::plan::{SampledToken, SeqResult, SeqStep, StepOutput};
    use crate::LogitsRequest;

    /// Answers each sequence with its context length as the token; panics on a 0-sequence plan.
    struct Echo {
        steps: usize,
    }

    impl StepRunner for Echo {
        type Step = StepPlanOne;
        type Output = StepOutput;
        fn run_step(&mut self, plan: &StepPlanOne) -> anyhow::Result<StepOutput> {
            let plan = &plan.0;
            assert!(!plan.seqs.is_empty(), "empty plan");
            self.steps += 1;
            let sampled =
                |s: &SeqStep| Some(SampledToken { token: s.context_len as u32, logprob: 0.0, top_logprobs: vec![] });
            Ok(StepOutput {
                seqs: plan
                    .seqs
                    .iter()
                    .map(|s| SeqResult {
                        seq_id: s.seq_id,
                        logits: vec![],
                        sampled: sampled(s),
                        extra_tokens: vec![],
                        drafts: vec![],
                        scores: vec![],
                    })
                    .collect(),
            })
        }
    }

    /// One plan as a step (the thread's unit in these tests).
    struct StepPlanOne(StepPlan);

    impl StepSize for StepPlanOne {
        fn size(&self) -> StepShape {
            vec![self.0.clone()].size()
        }
    }

    fn plan(ctx: &[usize]) -> Arc<StepPlanOne> {
        let seq = |(i, &c): (usize, &usize)| SeqStep {
            fork: None,
            seq_id: i as u64,
            tokens: vec![1],
            context_len: c,
            block_table: vec![0],
            logits: LogitsRequest::None,
            sample: None,
            mtp: None,
        };
        Arc::new(StepPlanOne(StepPlan { kind: StepKind::Decode, seqs: ctx.iter().enumerate().map(seq).collect() }))
    }

    fn tokens(out: &StepOutput) -> Vec<u32> {
        out.seqs.iter().map(|s| s.sampled.as_ref().unwrap().token).collect()
    }

    #[test]
    fn steps_and_jobs_run_in_order_on_the_thread() {
        let (mut t, ready) = StepThread::spawn("test-step-thread".into(), || Ok((Echo { steps: 0 }, 7u32))).unwrap();
        assert_eq!(ready, 7);
        let caller = std::thread::current().id();
        for ctx in [3usize, 4, 5] {
            let p = plan(&[ctx, ctx + 10]);
            t.start_step(&p);
            assert_eq!(tokens(&t.finish_step().unwrap()), vec![ctx as u32, ctx as u32 + 10]);
            // The thread let go of the plan before answering.
            assert_eq!(Arc::strong_count(&p), 1);
        }
        assert_eq!(tokens(&t.step(Arc::try_unwrap(plan(&[9])).ok().unwrap()).unwrap()), vec![9]);
        // A job queued behind a step in flight runs after it, on the step thread.
        t.start_step(&plan(&[1]));
        let (steps, on) = t.with(|e| (e.steps, std::thread::current().id())).unwrap();
        assert_eq!(steps, 5);
        assert_ne!(on, caller);
        assert_eq!(tokens(&t.finish_step().unwrap()), vec![1]);
    }

    #[test]
    fn failures_are_errors_not_hangs() {
        let failed = StepThread::<Echo>::spawn::<(), _>("test-step-thread".into(), || anyhow::bail!("no device"));
        assert!(failed.err().unwrap().to_string().contains("no device"));
        let (mut t, ()) = StepThread::spawn("test-step-thread".into(), || Ok((Echo { steps: 0 }, ()))).unwrap();
        assert!(t.finish_step().is_err(), "nothing was started");
        // The runner panics on an empty plan: the thread is gone, and so is every later step.
        t.start_step(&plan(&[]));
        assert!(t.finish_step().unwrap_err().to_string().contains("panicked"));
        t.start_step(&plan(&[1]));
        assert!(t.finish_step().is_err());
        assert!(t.with(|e| e.steps).is_err());
    }

    /// A step that outlives the deadline stays in flight and can be collected later; a thread
    /// stuck for good can be detached without hanging the caller.
    #[test]
    fn a_deadline_leaves_the_step_in_flight() {
        let gate = Arc::new(std::sync::Barrier::new(2));
        let (mut t, ()) = StepThread::spawn("test-step-thread".into(), || Ok((Echo { steps: 0 }, ()))).unwrap();
        let g = gate.clone();
        // A job that blocks the thread until the test lets it go; the step queues behind it.
        t.send(Msg::Job(Box::new(move |_| {
            g.wait();
        })))
        .unwrap();
        t.start_step(&plan(&[4]));
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(t.finish_step_until(Some(soon)).is_none(), "the step cannot have run");
        gate.wait();
        assert_eq!(tokens(&t.finish_step_until(None).unwrap().unwrap()), vec![4]);
        // Stuck for good: detaching returns at once.
        let stuck = Arc::new(std::sync::Barrier::new(2));
        let s2 = stuck.clone();
        t.send(Msg::Job(Box::new(move |_| {
            s2.wait();
        })))
        .unwrap();
        let before = Instant::now();
        t.detach();
        assert!(before.elapsed() < Duration::from_secs(1));
        stuck.wait();
    }
}
