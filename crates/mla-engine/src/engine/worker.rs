//! The engine thread: owns the backend and the scheduler; each iteration drains commands, drops
//! requests whose client is gone, runs one step and delivers its events.

use super::backend_call::{run_checked, split_by_request};
use super::Command;
use crate::api::{EngineConfig, EngineEvent, FinishReason, GenerateRequest, RequestTimings, TokenLogprobs};
use crate::metrics::Metrics;
use crate::scheduler::{EarlyFinish, Scheduler, SchedulerConfig};
use crate::sequence::SeqKey;
use mla_core::plan::{StepOutput, StepPlan};
use mla_core::sampling::SplitMix64;
use mla_core::Backend;
use std::collections::HashMap;
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
    clients: HashMap<u64, Client>,
    metrics: Metrics,
    queued: Arc<AtomicUsize>,
    /// Seeds requests that bring none, in arrival order.
    seeds: SplitMix64,
    deadline: Option<Instant>,
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
        Worker { backend, sched, inbox, clients: HashMap::new(), metrics, queued, seeds, deadline: None }
    }

    pub fn run(mut self) {
        while self.pump_commands() {
            self.drop_departed_clients();
            if self.deadline.is_some_and(|d| !self.sched.has_work() || Instant::now() >= d) {
                break;
            }
            match self.sched.schedule() {
                Some(plan) => self.execute(plan),
                None if self.sched.has_work() => {
                    // Admission guarantees progress (see `Scheduler`), so this is a bug; failing
                    // the stuck requests keeps it visible instead of hanging their clients.
                    tracing::error!("the scheduler has work but built no step");
                    let ids: Vec<u64> = self.clients.keys().copied().collect();
                    ids.into_iter().for_each(|id| self.fail(id, "internal error: the scheduler made no progress".into()));
                }
                None => {}
            }
            self.publish();
        }
        let ids: Vec<u64> = self.clients.keys().copied().collect();
        ids.into_iter().for_each(|id| self.abort(id, true));
        // Submissions that raced with shutdown never ran; tell their clients.
        while let Ok(cmd) = self.inbox.try_recv() {
            if let Command::Submit { req, events, .. } = cmd {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                self.metrics.count_finished(FinishReason::Abort, req.n as u64);
                (0..req.n).for_each(|index| drop(events.send(EngineEvent::Finished { index, reason: FinishReason::Abort })));
            }
        }
        self.publish();
    }

    /// Handles pending commands, blocking while there is nothing to run so an idle engine costs
    /// nothing. False once every handle and stream is gone and no work is left.
    fn pump_commands(&mut self) -> bool {
        if !self.sched.has_work() && self.deadline.is_none() {
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

    fn execute(&mut self, plan: StepPlan) {
        self.mark_scheduled(&plan);
        let err = match self.run_backend(&plan) {
            Ok(out) => return self.deliver(&plan, &out),
            Err(e) => e,
        };
        let parts = split_by_request(&plan);
        if parts.len() == 1 {
            return self.fail(parts[0].0, format!("backend error: {err:#}"));
        }
        // A failed batch is retried one request at a time so that one bad request cannot take
        // its batch-mates down; the backend leaves only the fed positions unspecified, and the
        // retry rewrites them.
        tracing::warn!("backend step over {} requests failed ({err:#}); retrying them one by one", parts.len());
        for (id, part) in parts {
            match self.run_backend(&part) {
                Ok(out) => self.deliver(&part, &out),
                Err(e) => self.fail(id, format!("backend error: {e:#}")),
            }
        }
    }

    fn run_backend(&mut self, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        run_checked(self.backend.as_mut(), plan)
    }

    fn mark_scheduled(&mut self, plan: &StepPlan) {
        let now = Instant::now();
        let mut stats = self.metrics.lock();
        for s in &plan.seqs {
            let client = self.clients.get_mut(&SeqKey::from_seq_id(s.seq_id).request).expect("scheduled request has a client");
            if client.timings.first_scheduled.is_none() {
                client.timings.first_scheduled = Some(now);
                self.queued.fetch_sub(1, Ordering::SeqCst);
                stats.queue_time.observe((now - client.timings.arrived).as_secs_f64());
                stats.prompt_tokens_total += client.prompt_len as u64;
            }
        }
    }

    fn deliver(&mut self, plan: &StepPlan, out: &StepOutput) {
        let now = Instant::now();
        let applied = self.sched.apply(plan, out);
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
            let logprobs = client
                .wants_logprobs
                .then(|| TokenLogprobs { logprob: t.token.logprob, top: t.token.top_logprobs.clone() });
            let _ = client.events.send(EngineEvent::Token { index: t.index, token: t.token.token, logprobs, finish: t.finish });
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
