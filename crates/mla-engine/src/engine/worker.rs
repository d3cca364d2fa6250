//! The engine thread: owns the backend and one scheduler per attention rank (one, or one per
//! device under DP attention); each iteration collects the step in flight, handles commands,
//! drops requests whose client is gone, starts the next step and delivers the events of the one
//! before. A new request comes with the attention rank the handle's router chose for it. This
//! file holds the loop, the commands, and how a step is launched and concluded; what it leans
//! on lives beside it: `client` (each request's record and its accounting when it ends),
//! `delivery` (the events waiting to go out), `turns` (which kind of step the ranks take) and
//! `gauges` (what it publishes to the statistics).
//!
//! The next step is handed to the backend (`Backend::start_step`) before the previous step's
//! tokens go out to the clients, so a device that runs steps on a thread of its own does not wait
//! for that bookkeeping. What a step delivers is fixed when it is applied; commands that end or
//! change a request first deliver what it still has pending (`Worker::with_pending_delivered`,
//! which every such command goes through), so every client sees its events in the order a
//! synchronous engine sends them.
//!
//! A failed step is retried one request at a time (the other ranks idle), so one bad request
//! cannot take its batch-mates down, unless the backend says it cannot go on
//! (`FatalBackendError`: a rank died, a collective broke): then every request fails and the
//! engine stops, marked dead for the handle.

use super::backend_call::{check_outputs, panic_text, run_checked, split_by_request};
use super::client::{Client, Clients};
use super::delivery::{announce_admissions, Outbox};
use super::gauges;
use super::rank_loads::{request_cost, RankLoads};
use super::router::RankCache;
use super::spec_rule::SpecRule;
use super::turns::{idle, Turns};
use super::{Command, Liveness};
use crate::api::{EngineConfig, EngineEvent, FinishReason, GenerateRequest};
use crate::metrics::Metrics;
use crate::prefix_hash::BlockHash;
use crate::scheduler::{Applied, EarlyFinish, Scheduler, SchedulerConfig};
use crate::stats::MaskStats;
use mla_core::step::plan::{StepOutput, StepPlan};
use mla_core::{Backend, FatalBackendError, SplitMix64};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What the handle shares with the engine thread.
pub(super) struct Links {
    pub inbox: Receiver<Command>,
    pub metrics: Metrics,
    /// Requests submitted and not yet scheduled (the `max_queued_requests` count).
    pub queued: Arc<AtomicUsize>,
    /// Work each rank has taken on; the handle adds a request's cost when it routes the request
    /// here, the engine takes it off when the request ends.
    pub loads: Arc<RankLoads>,
    pub liveness: Arc<Liveness>,
}

pub(super) struct Worker {
    backend: Box<dyn Backend>,
    /// One scheduler (and KV cache) per attention rank.
    ranks: Vec<Scheduler>,
    links: Links,
    clients: Clients,
    /// The last step's events, applied and not yet delivered.
    outbox: Outbox,
    /// Seeds requests that bring none, in arrival order.
    seeds: SplitMix64,
    deadline: Option<Instant>,
    /// Which kind of step the ranks take next.
    turns: Turns,
    /// Steps finished (or being finished), for the test hook `MLA_TEST_HANG_STEP`.
    steps: u64,
    /// Threads that compute structured-output masks together (the host's cores).
    mask_threads: usize,
    masks: MaskStats,
    /// The measured load rule of speculative decoding (`EngineConfig::spec_load_rule`): one for
    /// all ranks, which step together.
    spec_rule: Option<SpecRule>,
}

/// A request the handle routed to one of this engine's ranks.
struct Admission {
    id: u64,
    req: GenerateRequest,
    events: UnboundedSender<EngineEvent>,
    arrived: Instant,
    rank: usize,
    hashes: Vec<BlockHash>,
}

/// What a request that ends before its completions did tells its client last.
enum LastWord {
    /// Nothing: the client is gone.
    Nothing,
    /// Each unfinished completion finished as aborted.
    Aborted,
    /// This event (an error, a rejection).
    Event(EngineEvent),
}

/// A step the backend is running.
struct InFlight {
    plans: Arc<Vec<StepPlan>>,
    /// When it was handed to the backend (its duration feeds the measured load rule).
    launched: Instant,
}

impl Worker {
    /// `caches`: for each attention rank, how the router sees its prefix cache (none under the
    /// least-loaded policy).
    pub fn new(backend: Box<dyn Backend>, cfg: EngineConfig, links: Links, caches: Vec<Option<RankCache>>) -> Self {
        // Every step stays within what the backend was sized for (`StepLimits`), which may be
        // less than the flags asked for (its memory planner).
        let step = backend.step_limits();
        let limits = SchedulerConfig {
            max_model_len: cfg.max_model_len,
            max_num_seqs: cfg.max_num_seqs.min(step.rank_seqs),
            max_num_batched_tokens: cfg.max_num_batched_tokens.min(step.rank_tokens),
            long_prefill_token_threshold: cfg.long_prefill_token_threshold,
            max_extra_logit_rows: step.extra_logit_rows(),
            prefix_caching: cfg.prefix_caching,
            mixed_steps: cfg.mixed_steps,
            mtp_drafts: cfg.mtp_drafts,
            spec_disable_batch: cfg.spec_disable_batch,
            spec_sampled: backend.verifies_sampled_drafts(),
            spec_shaped: backend.verifies_shaped_drafts(),
            fork_blocks: backend.forks_blocks(),
        };
        let layouts = backend.cache_layouts();
        assert_eq!(layouts.len(), caches.len(), "one router view per attention rank");
        let ranks: Vec<Scheduler> = layouts
            .into_iter()
            .zip(caches)
            .map(|(l, cache)| match cache {
                Some(c) => Scheduler::published(limits, l, c.hasher, c.publisher),
                None => Scheduler::new(limits, l),
            })
            .collect();
        Worker {
            backend,
            ranks,
            clients: Clients::new(links.queued.clone(), links.loads.clone()),
            outbox: Outbox::new(links.metrics.clone()),
            links,
            seeds: SplitMix64::new(cfg.seed),
            deadline: None,
            turns: Turns::new(),
            steps: 0,
            mask_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            masks: MaskStats::default(),
            spec_rule: (cfg.spec_load_rule && cfg.mtp_drafts > 0).then(SpecRule::default),
        }
    }

    fn has_work(&self) -> bool {
        self.ranks.iter().any(Scheduler::has_work)
    }

    pub fn run(mut self) {
        let mut in_flight: Option<InFlight> = None;
        loop {
            if let Some(f) = in_flight.take() {
                if !self.finish(f) {
                    break;
                }
            }
            if !self.pump_commands() {
                break;
            }
            self.drop_departed_clients();
            if self.deadline.is_some_and(|d| !self.has_work() || Instant::now() >= d) {
                break;
            }
            if let Some(rule) = self.spec_rule.as_mut() {
                let batch = self.ranks.iter().map(Scheduler::num_running).sum();
                let drafts = rule.consult(batch);
                self.ranks.iter_mut().for_each(|r| r.rule_out_drafting(!drafts));
            }
            let plans = self.turns.schedule(&mut self.ranks);
            if plans.iter().any(|p| !p.seqs.is_empty()) {
                in_flight = Some(self.launch(plans));
            } else if self.has_work() {
                // Admission guarantees progress (see `Scheduler`), so this is a bug; failing
                // the stuck requests keeps it visible instead of hanging their clients.
                tracing::error!("the scheduler has work but built no step");
                let ids = self.clients.ids();
                ids.into_iter().for_each(|id| self.fail(id, "internal error: the scheduler made no progress".into()));
            }
            // While the backend runs the step just started, the previous one goes out.
            self.outbox.flush(&mut self.clients);
            self.publish();
        }
        self.outbox.flush(&mut self.clients);
        let ids = self.clients.ids();
        ids.into_iter().for_each(|id| self.abort(id, true));
        // Submissions that raced with shutdown (or the engine's death) never ran; tell their
        // clients, with the reason the engine stopped if it died.
        let died = self.links.liveness.death();
        while let Ok(cmd) = self.links.inbox.try_recv() {
            if let Command::Submit { req, events, rank, .. } = cmd {
                self.links.queued.fetch_sub(1, Ordering::SeqCst);
                self.links.loads.release(rank, request_cost(&req));
                self.links.metrics.count_finished(FinishReason::Abort, req.n as u64);
                match &died {
                    Some(why) => drop(events.send(EngineEvent::Error { message: why.clone() })),
                    None => (0..req.n).for_each(|index| {
                        drop(events.send(EngineEvent::Finished { index, reason: FinishReason::Abort }))
                    }),
                }
            }
        }
        self.publish();
    }

    /// Handles pending commands, blocking while there is nothing to run so an idle engine costs
    /// nothing. False once every handle and stream is gone and no work is left.
    fn pump_commands(&mut self) -> bool {
        if !self.has_work() && self.deadline.is_none() {
            // Nothing runs until a command comes: whatever is pending goes out first.
            self.outbox.flush(&mut self.clients);
            self.publish();
            match self.links.inbox.recv() {
                Ok(cmd) => self.handle(cmd),
                Err(_) => return false,
            }
        }
        loop {
            match self.links.inbox.try_recv() {
                Ok(cmd) => self.handle(cmd),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return self.has_work() || self.deadline.is_some(),
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { id, req, events, arrived, rank, hashes } => {
                self.admit(Admission { id, req: *req, events, arrived, rank, hashes })
            }
            Command::Abort(id) => self.abort(id, true),
            Command::FinishChoice { id, index, reason } => self.finish_choice(id, index, reason),
            Command::Shutdown { deadline } => self.deadline = Some(self.deadline.map_or(deadline, |d| d.min(deadline))),
        }
    }

    fn admit(&mut self, a: Admission) {
        let Admission { id, req, events, arrived, rank, hashes } = a;
        let seed = req.seed.unwrap_or_else(|| self.seeds.next_u64());
        self.clients.insert(id, Client::new(events, &req, arrived, rank));
        self.ranks[rank].add_hashed(id, req, seed, hashes);
    }

    /// Runs `change` on request `id`, with its attention rank, once what the request still has
    /// pending has gone out; nothing if the request is gone (its pending events may have ended
    /// it). Every command that ends or changes one request goes through here, the only place
    /// that flushes one request's events, so its client sees them in the order a synchronous
    /// engine would send them.
    fn with_pending_delivered(&mut self, id: u64, change: impl FnOnce(&mut Self, usize)) {
        self.outbox.flush_request(id, &mut self.clients);
        if let Some(rank) = self.clients.rank_of(id) {
            change(self, rank);
        }
    }

    /// Forgets a request and frees its blocks; `notify` tells a still-listening client.
    fn abort(&mut self, id: u64, notify: bool) {
        self.end_request(id, if notify { LastWord::Aborted } else { LastWord::Nothing });
    }

    /// Fails a request; its unfinished completions count as aborted (they ended neither by a
    /// stop nor by length, and the server reports them as aborted).
    fn fail(&mut self, id: u64, message: String) {
        self.end_request(id, LastWord::Event(EngineEvent::Error { message }));
    }

    /// Ends a request its own structured-output constraint cannot go on with (see
    /// `EngineEvent::Rejected`), as `fail` does.
    fn reject(&mut self, id: u64, why: String) {
        self.end_request(id, LastWord::Event(EngineEvent::Rejected { message: format!("structured output: {why}") }));
    }

    /// Ends a request before its completions did: its blocks are freed, its unfinished
    /// completions count as aborted, and its client hears `last`.
    fn end_request(&mut self, id: u64, last: LastWord) {
        self.with_pending_delivered(id, |w, rank| {
            let Some(unfinished) = w.ranks[rank].remove_request(id) else { return };
            w.links.metrics.count_finished(FinishReason::Abort, unfinished.len() as u64);
            let client = w.clients.cut_short(id, &mut w.links.metrics.lock());
            match last {
                LastWord::Nothing => {}
                LastWord::Aborted => {
                    for index in unfinished {
                        let _ = client.events.send(EngineEvent::Finished { index, reason: FinishReason::Abort });
                    }
                }
                LastWord::Event(event) => drop(client.events.send(event)),
            }
        });
    }

    /// Ends one completion for the caller; see `RequestStream::finish_choice`. When it was the
    /// request's last, the request completed (it gets an end-to-end latency, unlike an abort).
    fn finish_choice(&mut self, id: u64, index: usize, reason: FinishReason) {
        self.with_pending_delivered(id, |w, rank| {
            let Some(ended) = w.ranks[rank].finish_completion(id, index, reason) else { return };
            w.links.metrics.count_finished(reason, 1);
            let client = w.clients.expect_mut(id);
            client.completion_ended(reason);
            let _ = client.events.send(EngineEvent::Finished { index, reason });
            if ended == EarlyFinish::Request {
                w.clients.complete(id, Instant::now(), &mut w.links.metrics.lock());
            }
        });
    }

    /// A closed receiver means the client went away: abort within this step. Commands the
    /// client sent before closing (a `finish_choice` for its last live completion, typically)
    /// are handled first, so its completions end with the reason it gave rather than as aborts.
    fn drop_departed_clients(&mut self) {
        let gone = self.clients.departed();
        if gone.is_empty() {
            return;
        }
        // Everything sent before a receiver was dropped is in the inbox by the time the closed
        // receiver is seen.
        while let Ok(cmd) = self.links.inbox.try_recv() {
            self.handle(cmd);
        }
        gone.into_iter().for_each(|id| self.abort(id, false));
    }

    /// Hands the step to the backend. A panic while starting is the step's failure.
    fn launch(&mut self, plans: Vec<StepPlan>) -> InFlight {
        let launched = Instant::now();
        let plans = Arc::new(plans);
        self.links.liveness.step_started();
        let backend = &mut self.backend;
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| backend.start_step(&plans))) {
            // finish_step then reports the step as never started (or panics again, also caught).
            tracing::error!("backend panicked starting a step: {}", panic_text(&p));
        }
        // Structured-output masks are computed now, while the backend runs the forward pass;
        // its sampler waits for them.
        let (vocab, started) = (self.backend.model_config().vocab_size, Instant::now());
        let (mut masks, mut failed) = (0, vec![]);
        for rank in self.ranks.iter_mut() {
            let filled = rank.fill_masks(vocab, self.mask_threads);
            masks += filled.count;
            failed.extend(filled.failed);
        }
        if masks > 0 {
            self.masks.record(masks, started.elapsed());
        }
        {
            let mut stats = self.links.metrics.lock();
            plans.iter().for_each(|p| self.clients.mark_scheduled(p, &mut stats));
        }
        gauges::count_step_tokens(&self.links.metrics, &plans);
        announce_admissions(&mut self.ranks, &self.clients);
        // A request whose constraint failed leaves now; the step still computes its rows, and
        // applying it skips requests that are gone, so its token is never delivered.
        for (id, why) in failed {
            self.reject(id, why);
        }
        InFlight { plans, launched }
    }

    /// Waits for the step in flight and applies it; false when the engine cannot go on.
    fn finish(&mut self, f: InFlight) -> bool {
        self.steps += 1;
        mla_core::runtime::fault::maybe_hang(self.steps);
        let backend = &mut self.backend;
        let result = catch_unwind(AssertUnwindSafe(|| backend.finish_step()))
            .unwrap_or_else(|p| Err(anyhow::anyhow!("backend panicked: {}", panic_text(&p))))
            .and_then(|outs| check_outputs(&f.plans, &outs).map(|()| outs));
        self.links.liveness.step_ended();
        self.conclude(f.plans, result, f.launched.elapsed())
    }

    /// Applies a step's outputs, or handles its failure: a failed step is retried one request at
    /// a time, the other ranks idle, so that one bad request cannot take its batch-mates down
    /// (the backend leaves only the fed positions unspecified, and the retry rewrites them). A
    /// fatal failure ends the engine instead: false.
    fn conclude(&mut self, plans: Arc<Vec<StepPlan>>, result: anyhow::Result<Vec<StepOutput>>, took: Duration) -> bool {
        let err = match result {
            Ok(outs) => {
                self.apply_all(&plans, &outs);
                if let Some(rule) = self.spec_rule.as_mut() {
                    rule.observe(&plans, &outs, took);
                }
                // The backend has dropped its references by now (its threads do before they
                // answer); if not, the plans are simply freed.
                if let Ok(plans) = Arc::try_unwrap(plans) {
                    for (sched, plan) in self.ranks.iter_mut().zip(plans) {
                        sched.recycle(plan);
                    }
                }
                return true;
            }
            Err(e) => e,
        };
        if let Some(fatal) = err.downcast_ref::<FatalBackendError>() {
            self.die(format!("the backend failed and cannot continue: {fatal}"));
            return false;
        }
        let parts: Vec<(usize, u64, StepPlan)> = plans
            .iter()
            .enumerate()
            .flat_map(|(r, p)| split_by_request(p).into_iter().map(move |(id, part)| (r, id, part)))
            .collect();
        if parts.len() == 1 {
            self.fail(parts[0].1, format!("backend error: {err:#}"));
            return true;
        }
        tracing::warn!("backend step over {} requests failed ({err:#}); retrying them one by one", parts.len());
        for (rank, id, part) in parts {
            // Each part's events go out before the next part runs, as they always did.
            self.outbox.flush(&mut self.clients);
            let mut alone: Vec<StepPlan> = (0..self.ranks.len()).map(|_| idle()).collect();
            alone[rank] = part;
            match run_checked(self.backend.as_mut(), &alone) {
                Ok(outs) => self.apply_all(&alone, &outs),
                Err(e) if e.downcast_ref::<FatalBackendError>().is_some() => {
                    self.die(format!("the backend failed and cannot continue: {e:#}"));
                    return false;
                }
                Err(e) => self.fail(id, format!("backend error: {e:#}")),
            }
        }
        true
    }

    /// The backend cannot run another step: every request fails with `why`, the handle learns
    /// the engine is dead (health checks, new submissions), and the thread ends.
    fn die(&mut self, why: String) {
        tracing::error!("{why}");
        self.links.liveness.mark_dead(why.clone());
        self.outbox.flush(&mut self.clients);
        let ids = self.clients.ids();
        ids.into_iter().for_each(|id| self.fail(id, why.clone()));
    }

    /// Records every rank's output in its scheduler; the events wait in the outbox.
    fn apply_all(&mut self, plans: &[StepPlan], outs: &[StepOutput]) {
        debug_assert!(self.outbox.is_empty(), "a step's events were never delivered");
        self.outbox.flush(&mut self.clients);
        let mut applied = Applied::default();
        for ((sched, plan), out) in self.ranks.iter_mut().zip(plans).zip(outs) {
            let a = sched.apply(plan, out);
            applied.prompt_logprobs.extend(a.prompt_logprobs);
            applied.tokens.extend(a.tokens);
            applied.finished_requests.extend(a.finished_requests);
            applied.rejected.extend(a.rejected);
        }
        let rejected = std::mem::take(&mut applied.rejected);
        self.outbox.hold(applied, Instant::now());
        // After the step's other events of the request (its other completions' tokens).
        for (id, why) in rejected {
            self.reject(id, why);
        }
    }

    /// Publishes the ranks' gauges (see `gauges`).
    fn publish(&self) {
        gauges::publish(&self.links.metrics, &self.ranks, &self.links.loads, self.masks);
    }
}
