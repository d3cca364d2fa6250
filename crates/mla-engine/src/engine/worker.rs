//! The engine thread: owns the backend and the scheduler; each iteration collects the step in
//! flight, handles commands, drops requests whose client is gone, starts the next step and
//! delivers the events of the one before.
//!
//! With a backend that runs steps on a thread of its own (`Backend::start_step`), the next step
//! is handed over before the previous step's tokens go out to the clients, so the device does
//! not wait for that bookkeeping. What a step delivers is fixed when it is applied; commands that
//! end a request first deliver what it still has pending, so every client sees its events in the
//! order a synchronous engine sends them. With a synchronous backend the order is unchanged: the
//! previous step is delivered before the next one runs.

use super::backend_call::{check_output, panic_text, run_checked, split_by_request};
use super::Command;
use crate::api::{EngineConfig, EngineEvent, FinishReason, GenerateRequest, RequestTimings, TokenLogprobs};
use crate::id_map::IdMap;
use crate::metrics::Metrics;
use crate::scheduler::{Applied, EarlyFinish, Scheduler, SchedulerConfig};
use crate::sequence::SeqKey;
use mla_core::plan::{StepKind, StepOutput, StepPlan};
use mla_core::Backend;
use mla_core::SplitMix64;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A request's link to its client, and its timings.
struct Client {
    events: UnboundedSender<EngineEvent>,
    timings: RequestTimings,
    wants_logprobs: bool,
    prompt_len: usize,
    /// When each completion last produced a token (inter-token latency).
    last_token: Vec<Option<Instant>>,
}

pub(super) struct Worker {
    backend: Box<dyn Backend>,
    sched: Scheduler,
    inbox: Receiver<Command>,
    clients: IdMap<Client>,
    metrics: Metrics,
    queued: Arc<AtomicUsize>,
    /// Seeds requests that bring none, in arrival order.
    seeds: SplitMix64,
    deadline: Option<Instant>,
    /// Applied and not yet delivered: the last step's outcome, when it was applied.
    undelivered: Option<(Applied, Instant)>,
}

/// A step the backend is running on its own thread.
struct InFlight {
    plan: Arc<StepPlan>,
}

impl Worker {
    pub fn new(
        backend: Box<dyn Backend>,
        cfg: EngineConfig,
        inbox: Receiver<Command>,
        metrics: Metrics,
        queued: Arc<AtomicUsize>,
    ) -> Self {
        let limits = SchedulerConfig {
            max_model_len: cfg.max_model_len,
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
        };
        let sched = Scheduler::new(limits, backend.cache_layout());
        let seeds = SplitMix64::new(cfg.seed);
        Worker {
            backend,
            sched,
            inbox,
            clients: IdMap::default(),
            metrics,
            queued,
            seeds,
            deadline: None,
            undelivered: None,
        }
    }

    pub fn run(mut self) {
        let mut in_flight: Option<InFlight> = None;
        loop {
            if let Some(f) = in_flight.take() {
                self.finish(f);
            }
            if !self.pump_commands() {
                break;
            }
            self.drop_departed_clients();
            if self.deadline.is_some_and(|d| !self.sched.has_work() || Instant::now() >= d) {
                break;
            }
            match self.sched.schedule() {
                Some(plan) => in_flight = self.launch(plan),
                None if self.sched.has_work() => {
                    // Admission guarantees progress (see `Scheduler`), so this is a bug; failing
                    // the stuck requests keeps it visible instead of hanging their clients.
                    tracing::error!("the scheduler has work but built no step");
                    let ids: Vec<u64> = self.clients.keys().copied().collect();
                    ids.into_iter()
                        .for_each(|id| self.fail(id, "internal error: the scheduler made no progress".into()));
                }
                None => {}
            }
            // While the backend runs the step just started, the previous one goes out.
            self.deliver_undelivered();
            self.publish();
        }
        self.deliver_undelivered();
        let ids: Vec<u64> = self.clients.keys().copied().collect();
        ids.into_iter().for_each(|id| self.abort(id, true));
        // Submissions that raced with shutdown never ran; tell their clients.
        while let Ok(cmd) = self.inbox.try_recv() {
            if let Command::Submit { req, events, .. } = cmd {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                self.metrics.count_finished(FinishReason::Abort, req.n as u64);
                (0..req.n)
                    .for_each(|index| drop(events.send(EngineEvent::Finished { index, reason: FinishReason::Abort })));
            }
        }
        self.publish();
    }

    /// Handles pending commands, blocking while there is nothing to run so an idle engine costs
    /// nothing. False once every handle and stream is gone and no work is left.
    fn pump_commands(&mut self) -> bool {
        if !self.sched.has_work() && self.deadline.is_none() {
            // Nothing runs until a command comes: whatever is pending goes out first.
            self.deliver_undelivered();
            self.publish();
            match self.inbox.recv() {
                Ok(cmd) => self.handle(cmd),
                Err(_) => return false,
            }
        }
        loop {
            match self.inbox.try_recv() {
                Ok(cmd) => self.handle(cmd),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return self.sched.has_work() || self.deadline.is_some(),
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { id, req, events, arrived } => self.admit(id, req, events, arrived),
            Command::Abort(id) => self.abort(id, true),
            Command::FinishChoice { id, index, reason } => self.finish_choice(id, index, reason),
            Command::Shutdown { deadline } => self.deadline = Some(self.deadline.map_or(deadline, |d| d.min(deadline))),
        }
    }

    fn admit(&mut self, id: u64, req: GenerateRequest, events: UnboundedSender<EngineEvent>, arrived: Instant) {
        let seed = req.seed.unwrap_or_else(|| self.seeds.next_u64());
        let timings = RequestTimings { arrived, first_scheduled: None, first_token: None, finished: None };
        let client = Client {
            events,
            timings,
            wants_logprobs: req.logprobs.is_some(),
            prompt_len: req.prompt_tokens.len(),
            last_token: vec![None; req.n],
        };
        self.clients.insert(id, client);
        self.sched.add(id, req, seed);
    }

    /// Forgets a request and frees its blocks; `notify` tells a still-listening client.
    fn abort(&mut self, id: u64, notify: bool) {
        self.deliver_pending_of(id);
        let Some(unfinished) = self.sched.remove_request(id) else { return };
        let client = self.forget(id);
        self.metrics.count_finished(FinishReason::Abort, unfinished.len() as u64);
        if notify {
            for index in unfinished {
                let _ = client.events.send(EngineEvent::Finished { index, reason: FinishReason::Abort });
            }
        }
    }

    /// Ends one completion for the caller; see `RequestStream::finish_choice`. When it was the
    /// request's last, the request completed (it gets an end-to-end latency, unlike an abort).
    fn finish_choice(&mut self, id: u64, index: usize, reason: FinishReason) {
        self.deliver_pending_of(id);
        let Some(ended) = self.sched.finish_completion(id, index, reason) else { return };
        self.metrics.count_finished(reason, 1);
        let client = self.clients.get(&id).expect("every scheduled request has a client");
        let _ = client.events.send(EngineEvent::Finished { index, reason });
        if ended == EarlyFinish::Request {
            let client = self.forget(id);
            self.metrics.lock().e2e_latency.observe(client.timings.arrived.elapsed().as_secs_f64());
        }
    }

    /// Fails a request; its unfinished completions count as aborted (they ended neither by a
    /// stop nor by length, and the server reports them as aborted).
    fn fail(&mut self, id: u64, message: String) {
        self.deliver_pending_of(id);
        if let Some(unfinished) = self.sched.remove_request(id) {
            self.metrics.count_finished(FinishReason::Abort, unfinished.len() as u64);
            let _ = self.forget(id).events.send(EngineEvent::Error { message });
        }
    }

    fn forget(&mut self, id: u64) -> Client {
        let client = self.clients.remove(&id).expect("every scheduled request has a client");
        if client.timings.first_scheduled.is_none() {
            self.queued.fetch_sub(1, Ordering::SeqCst);
        }
        client
    }

    /// A closed receiver means the client went away: abort within this step. Commands the
    /// client sent before closing (a `finish_choice` for its last live completion, typically)
    /// are handled first, so its completions end with the reason it gave rather than as aborts.
    fn drop_departed_clients(&mut self) {
        let gone: Vec<u64> = self.clients.iter().filter(|(_, c)| c.events.is_closed()).map(|(&id, _)| id).collect();
        if gone.is_empty() {
            return;
        }
        // Everything sent before a receiver was dropped is in the inbox by the time the closed
        // receiver is seen.
        while let Ok(cmd) = self.inbox.try_recv() {
            self.handle(cmd);
        }
        gone.into_iter().for_each(|id| self.abort(id, false));
    }

    /// Starts `plan`: on the backend's thread when it has one (returned as in flight), else
    /// right here, after the previous step's events went out (a synchronous step is applied and
    /// its own events wait for the end of the iteration, as an asynchronous one's would).
    fn launch(&mut self, plan: StepPlan) -> Option<InFlight> {
        let plan = Arc::new(plan);
        let backend = &mut self.backend;
        let started = catch_unwind(AssertUnwindSafe(|| backend.start_step(&plan)));
        self.mark_scheduled(&plan);
        let result = match started {
            Ok(true) => return Some(InFlight { plan }),
            Ok(false) => {
                self.deliver_undelivered();
                run_checked(self.backend.as_mut(), &plan)
            }
            Err(p) => Err(anyhow::anyhow!("backend panicked: {}", panic_text(&p))),
        };
        self.conclude(plan, result);
        None
    }

    /// Waits for the step in flight and applies it.
    fn finish(&mut self, f: InFlight) {
        let backend = &mut self.backend;
        let result = catch_unwind(AssertUnwindSafe(|| backend.finish_step()))
            .unwrap_or_else(|p| Err(anyhow::anyhow!("backend panicked: {}", panic_text(&p))))
            .and_then(|out| check_output(&f.plan, &out).map(|()| out));
        self.conclude(f.plan, result);
    }

    /// Applies a step's output, or handles its failure: a failed batch is retried one request at
    /// a time so that one bad request cannot take its batch-mates down; the backend leaves only
    /// the fed positions unspecified, and the retry rewrites them.
    fn conclude(&mut self, plan: Arc<StepPlan>, result: anyhow::Result<StepOutput>) {
        let err = match result {
            Ok(out) => {
                self.apply(&plan, &out);
                // The backend has dropped its reference by now (`StepThread` does before it
                // answers); if not, the plan is simply freed.
                if let Ok(plan) = Arc::try_unwrap(plan) {
                    self.sched.recycle(plan);
                }
                return;
            }
            Err(e) => e,
        };
        let parts = split_by_request(&plan);
        if parts.len() == 1 {
            return self.fail(parts[0].0, format!("backend error: {err:#}"));
        }
        tracing::warn!("backend step over {} requests failed ({err:#}); retrying them one by one", parts.len());
        for (id, part) in parts {
            // Each part's events go out before the next part runs, as they always did.
            self.deliver_undelivered();
            match run_checked(self.backend.as_mut(), &part) {
                Ok(out) => self.apply(&part, &out),
                Err(e) => self.fail(id, format!("backend error: {e:#}")),
            }
        }
    }

    fn mark_scheduled(&mut self, plan: &StepPlan) {
        // A decode step only feeds sequences that were prefilled, so scheduled, before.
        if plan.kind == StepKind::Decode {
            return;
        }
        let now = Instant::now();
        let mut stats = self.metrics.lock();
        for s in &plan.seqs {
            let client =
                self.clients.get_mut(&SeqKey::from_seq_id(s.seq_id).request).expect("scheduled request has a client");
            if client.timings.first_scheduled.is_none() {
                client.timings.first_scheduled = Some(now);
                self.queued.fetch_sub(1, Ordering::SeqCst);
                stats.queue_time.observe((now - client.timings.arrived).as_secs_f64());
                stats.prompt_tokens_total += client.prompt_len as u64;
            }
        }
    }

    /// Records a step's output in the scheduler; its events wait in `undelivered`.
    fn apply(&mut self, plan: &StepPlan, out: &StepOutput) {
        debug_assert!(self.undelivered.is_none(), "a step's events were never delivered");
        self.deliver_undelivered();
        let applied = self.sched.apply(plan, out);
        self.undelivered = Some((applied, Instant::now()));
    }

    /// Delivers the pending events of request `id` alone, before something else is sent to it.
    fn deliver_pending_of(&mut self, id: u64) {
        let Some((applied, at)) = self.undelivered.as_mut() else { return };
        if !applied.tokens.iter().any(|t| t.request == id) && !applied.finished_requests.contains(&id) {
            return;
        }
        let at = *at;
        let (tokens, rest) = std::mem::take(&mut applied.tokens).into_iter().partition(|t| t.request == id);
        applied.tokens = rest;
        let (finished_requests, rest) =
            std::mem::take(&mut applied.finished_requests).into_iter().partition(|&r| r == id);
        applied.finished_requests = rest;
        self.deliver(Applied { tokens, finished_requests }, at);
    }

    fn deliver_undelivered(&mut self) {
        if let Some((applied, at)) = self.undelivered.take() {
            self.deliver(applied, at);
        }
    }

    /// Sends a step's tokens and records their statistics, timed when the step was applied.
    fn deliver(&mut self, applied: Applied, now: Instant) {
        let mut stats = self.metrics.lock();
        for t in applied.tokens {
            let client = self.clients.get_mut(&t.request).expect("request has a client");
            stats.generation_tokens_total += 1;
            if client.timings.first_token.is_none() {
                client.timings.first_token = Some(now);
                stats.time_to_first_token.observe((now - client.timings.arrived).as_secs_f64());
            }
            if let Some(prev) = client.last_token[t.index].replace(now) {
                stats.inter_token_latency.observe((now - prev).as_secs_f64());
            }
            match t.finish {
                Some(FinishReason::Stop) => stats.finished_stop += 1,
                Some(FinishReason::Length) => stats.finished_length += 1,
                Some(FinishReason::Abort) | None => {}
            }
            let logprobs =
                client.wants_logprobs.then_some(TokenLogprobs { logprob: t.token.logprob, top: t.token.top_logprobs });
            let _ = client.events.send(EngineEvent::Token {
                index: t.index,
                token: t.token.token,
                logprobs,
                finish: t.finish,
            });
        }
        for id in applied.finished_requests {
            let client = self.clients.remove(&id).expect("request has a client");
            stats.e2e_latency.observe((now - client.timings.arrived).as_secs_f64());
        }
    }

    fn publish(&self) {
        let mut stats = self.metrics.lock();
        stats.running = self.sched.num_running();
        stats.waiting = self.sched.num_waiting();
        stats.kv_usage = self.sched.block_manager().usage();
        stats.preemptions_total = self.sched.preemptions();
    }
}
