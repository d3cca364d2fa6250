//! The engine thread: owns the backend and one scheduler per attention rank (one, or one per
//! device under DP attention); each iteration collects the step in flight, handles commands,
//! drops requests whose client is gone, starts the next step and delivers the events of the one
//! before. A new request comes with the attention rank the handle's router chose for it.
//!
//! The next step is handed to the backend (`Backend::start_step`) before the previous step's
//! tokens go out to the clients, so a device that runs steps on a thread of its own does not wait
//! for that bookkeeping. What a step delivers is fixed when it is applied; commands that end a
//! request first deliver what it still has pending, so every client sees its events in the order
//! a synchronous engine sends them.
//!
//! A failed step is retried one request at a time (the other ranks idle), so one bad request
//! cannot take its batch-mates down, unless the backend says it cannot go on
//! (`FatalBackendError`: a rank died, a collective broke): then every request fails and the
//! engine stops, marked dead for the handle.

use super::backend_call::{check_outputs, panic_text, run_checked, split_by_request};
use super::rank_loads::RankLoads;
use super::router::RankCache;
use super::{Command, Liveness};
use crate::api::{EngineConfig, EngineEvent, FinishReason, GenerateRequest, RequestTimings, TokenLogprobs};
use crate::id_map::IdMap;
use crate::metrics::Metrics;
use crate::prefix_hash::BlockHash;
use crate::request_stats::FinishedRequest;
use crate::scheduler::{Applied, EarlyFinish, Scheduler, SchedulerConfig};
use crate::sequence::SeqKey;
use crate::stats::{MaskStats, RankStats};
use mla_core::step::plan::{StepKind, StepOutput, StepPlan};
use mla_core::{Backend, FatalBackendError, SplitMix64};
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
    /// Tokens each completion produced, and the cap on them.
    completion_tokens: Vec<usize>,
    max_tokens: usize,
    /// How the request ends if nothing worse happens to it: see `worse`.
    reason: FinishReason,
    /// The attention rank serving it, and what it adds to that rank's load.
    rank: usize,
    cost: u64,
}

impl Client {
    /// Notes how one of its completions ended.
    fn completion_ended(&mut self, reason: FinishReason) {
        self.reason = worse(self.reason, reason);
    }

    /// The request as the statistics record it when it ends.
    fn finished(&self) -> FinishedRequest<'_> {
        FinishedRequest {
            reason: self.reason,
            first_scheduled: self.timings.first_scheduled,
            first_token: self.timings.first_token,
            last_token: self.last_token.iter().flatten().max().copied(),
            prompt_tokens: self.prompt_len,
            completion_tokens: &self.completion_tokens,
            max_tokens: self.max_tokens,
        }
    }
}

/// A request's finish reason from its completions': an abort stands for the whole request (it
/// did not complete), a length means the answer is truncated somewhere, else it stopped.
fn worse(a: FinishReason, b: FinishReason) -> FinishReason {
    let rank = |r| match r {
        FinishReason::Stop => 0,
        FinishReason::Length => 1,
        FinishReason::Abort => 2,
    };
    if rank(b) > rank(a) {
        b
    } else {
        a
    }
}

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
    clients: IdMap<Client>,
    /// Seeds requests that bring none, in arrival order.
    seeds: SplitMix64,
    deadline: Option<Instant>,
    /// Applied and not yet delivered: the last step's outcome, when it was applied.
    undelivered: Option<(Applied, Instant)>,
    /// Whether the last step of several ranks prefilled on any of them (see `schedule`).
    last_kind: StepKind,
    /// Steps finished (or being finished), for the test hook `MLA_TEST_HANG_STEP`.
    steps: u64,
    /// Threads that compute structured-output masks together (the host's cores).
    mask_threads: usize,
    masks: MaskStats,
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

/// A step the backend is running.
struct InFlight {
    plans: Arc<Vec<StepPlan>>,
}

/// What a request adds to its rank's load: the tokens its completions hold at most.
pub(super) fn request_cost(req: &GenerateRequest) -> u64 {
    (req.n * (req.prompt_tokens.len() + req.max_tokens)) as u64
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
            max_extra_logit_rows: step.extra_logit_rows(),
            prefix_caching: cfg.prefix_caching,
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
            links,
            clients: IdMap::default(),
            seeds: SplitMix64::new(cfg.seed),
            deadline: None,
            undelivered: None,
            steps: 0,
            last_kind: StepKind::Decode,
            mask_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            masks: MaskStats::default(),
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
            let plans = self.schedule();
            if plans.iter().any(|p| !p.seqs.is_empty()) {
                in_flight = Some(self.launch(plans));
            } else if self.has_work() {
                // Admission guarantees progress (see `Scheduler`), so this is a bug; failing
                // the stuck requests keeps it visible instead of hanging their clients.
                tracing::error!("the scheduler has work but built no step");
                let ids: Vec<u64> = self.clients.keys().copied().collect();
                ids.into_iter().for_each(|id| self.fail(id, "internal error: the scheduler made no progress".into()));
            }
            // While the backend runs the step just started, the previous one goes out.
            self.deliver_undelivered();
            self.publish();
        }
        self.deliver_undelivered();
        let ids: Vec<u64> = self.clients.keys().copied().collect();
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

    /// Every rank's plan for the next step (an idle rank's is empty). Several ranks take turns
    /// together: every rank with prompt work prefills in the same step, then every rank with
    /// sequences decodes, so a decoding rank waits for prefills once per turn rather than once
    /// per rank that prefills.
    fn schedule(&mut self) -> Vec<StepPlan> {
        let idle = || StepPlan { kind: StepKind::Decode, seqs: vec![] };
        if self.ranks.len() == 1 {
            return vec![self.ranks[0].schedule().unwrap_or_else(idle)];
        }
        let prefer = match self.last_kind {
            StepKind::Prefill => StepKind::Decode,
            StepKind::Decode => StepKind::Prefill,
        };
        let plans: Vec<StepPlan> =
            self.ranks.iter_mut().map(|s| s.schedule_prefer(prefer).unwrap_or_else(idle)).collect();
        let prefilled = plans.iter().any(|p| p.kind == StepKind::Prefill && !p.seqs.is_empty());
        self.last_kind = if prefilled { StepKind::Prefill } else { StepKind::Decode };
        plans
    }

    /// Handles pending commands, blocking while there is nothing to run so an idle engine costs
    /// nothing. False once every handle and stream is gone and no work is left.
    fn pump_commands(&mut self) -> bool {
        if !self.has_work() && self.deadline.is_none() {
            // Nothing runs until a command comes: whatever is pending goes out first.
            self.deliver_undelivered();
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
        let timings = RequestTimings { arrived, first_scheduled: None, first_token: None, finished: None };
        // The handle counted it on this rank's load already.
        let cost = request_cost(&req);
        let client = Client {
            events,
            timings,
            wants_logprobs: req.logprobs.is_some(),
            prompt_len: req.prompt_tokens.len(),
            last_token: vec![None; req.n],
            completion_tokens: vec![0; req.n],
            max_tokens: req.max_tokens,
            reason: FinishReason::Stop,
            rank,
            cost,
        };
        self.clients.insert(id, client);
        self.ranks[rank].add_hashed(id, req, seed, hashes);
    }

    fn rank_of(&self, id: u64) -> Option<usize> {
        self.clients.get(&id).map(|c| c.rank)
    }

    /// Forgets a request and frees its blocks; `notify` tells a still-listening client.
    fn abort(&mut self, id: u64, notify: bool) {
        self.deliver_pending_of(id);
        let Some(rank) = self.rank_of(id) else { return };
        let Some(unfinished) = self.ranks[rank].remove_request(id) else { return };
        let mut client = self.forget(id);
        self.links.metrics.count_finished(FinishReason::Abort, unfinished.len() as u64);
        client.completion_ended(FinishReason::Abort);
        self.links.metrics.lock().requests.record(&client.finished());
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
        let Some(rank) = self.rank_of(id) else { return };
        let Some(ended) = self.ranks[rank].finish_completion(id, index, reason) else { return };
        self.links.metrics.count_finished(reason, 1);
        let client = self.clients.get_mut(&id).expect("every scheduled request has a client");
        client.completion_ended(reason);
        let _ = client.events.send(EngineEvent::Finished { index, reason });
        if ended == EarlyFinish::Request {
            let client = self.forget(id);
            let mut stats = self.links.metrics.lock();
            stats.e2e_latency.observe(client.timings.arrived.elapsed().as_secs_f64());
            stats.requests.record(&client.finished());
        }
    }

    /// Fails a request; its unfinished completions count as aborted (they ended neither by a
    /// stop nor by length, and the server reports them as aborted).
    fn fail(&mut self, id: u64, message: String) {
        self.end_with(id, EngineEvent::Error { message });
    }

    /// Ends a request its own structured-output constraint cannot go on with (see
    /// `EngineEvent::Rejected`), as `fail` does.
    fn reject(&mut self, id: u64, why: String) {
        self.end_with(id, EngineEvent::Rejected { message: format!("structured output: {why}") });
    }

    fn end_with(&mut self, id: u64, last: EngineEvent) {
        self.deliver_pending_of(id);
        let Some(rank) = self.rank_of(id) else { return };
        if let Some(unfinished) = self.ranks[rank].remove_request(id) {
            self.links.metrics.count_finished(FinishReason::Abort, unfinished.len() as u64);
            let mut client = self.forget(id);
            client.completion_ended(FinishReason::Abort);
            self.links.metrics.lock().requests.record(&client.finished());
            let _ = client.events.send(last);
        }
    }

    /// Removes a request's client and takes its cost off its rank's load.
    fn forget(&mut self, id: u64) -> Client {
        let client = self.clients.remove(&id).expect("every scheduled request has a client");
        if client.timings.first_scheduled.is_none() {
            self.links.queued.fetch_sub(1, Ordering::SeqCst);
        }
        self.release(&client);
        client
    }

    fn release(&mut self, client: &Client) {
        self.links.loads.release(client.rank, client.cost);
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
        while let Ok(cmd) = self.links.inbox.try_recv() {
            self.handle(cmd);
        }
        gone.into_iter().for_each(|id| self.abort(id, false));
    }

    /// Hands the step to the backend. A panic while starting is the step's failure.
    fn launch(&mut self, plans: Vec<StepPlan>) -> InFlight {
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
        plans.iter().for_each(|p| self.mark_scheduled(p));
        self.count_step_tokens(&plans);
        self.announce_admissions();
        // A request whose constraint failed leaves now; the step still computes its rows, and
        // applying it skips requests that are gone, so its token is never delivered.
        for (id, why) in failed {
            self.reject(id, why);
        }
        InFlight { plans }
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
        self.conclude(f.plans, result)
    }

    /// Applies a step's outputs, or handles its failure: a failed step is retried one request at
    /// a time, the other ranks idle, so that one bad request cannot take its batch-mates down
    /// (the backend leaves only the fed positions unspecified, and the retry rewrites them). A
    /// fatal failure ends the engine instead: false.
    fn conclude(&mut self, plans: Arc<Vec<StepPlan>>, result: anyhow::Result<Vec<StepOutput>>) -> bool {
        let err = match result {
            Ok(outs) => {
                self.apply_all(&plans, &outs);
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
            self.deliver_undelivered();
            let mut alone: Vec<StepPlan> =
                (0..self.ranks.len()).map(|_| StepPlan { kind: StepKind::Decode, seqs: vec![] }).collect();
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
        self.deliver_undelivered();
        let ids: Vec<u64> = self.clients.keys().copied().collect();
        ids.into_iter().for_each(|id| self.fail(id, why.clone()));
    }

    /// Tells each request admitted since the last step how much of its prompt the prefix cache
    /// held (before any of its tokens, which come after the step).
    fn announce_admissions(&mut self) {
        for rank in &mut self.ranks {
            for (id, cached_tokens) in rank.take_admitted() {
                if let Some(client) = self.clients.get(&id) {
                    let _ = client.events.send(EngineEvent::Admitted { cached_tokens });
                }
            }
        }
    }

    /// Each rank that works in this step counts its tokens as vLLM's `iteration_tokens_total`
    /// does: prompt tokens computed plus tokens sampled. A decode step feeds the token it samples
    /// after, so it counts one per sequence; a prefill step counts its chunks and, for the chunks
    /// that end a prompt, the first token drawn.
    fn count_step_tokens(&self, plans: &[StepPlan]) {
        let mut stats = self.links.metrics.lock();
        for plan in plans.iter().filter(|p| !p.seqs.is_empty()) {
            let sampled = plan.seqs.iter().filter(|s| s.sample.is_some()).count();
            let tokens = match plan.kind {
                StepKind::Decode => sampled,
                _ => plan.seqs.iter().map(|s| s.tokens.len()).sum::<usize>() + sampled,
            };
            stats.iteration_tokens.observe(tokens as f64);
        }
    }

    fn mark_scheduled(&mut self, plan: &StepPlan) {
        // A decode step only feeds sequences that were prefilled, so scheduled, before.
        if plan.kind == StepKind::Decode {
            return;
        }
        let now = Instant::now();
        let mut stats = self.links.metrics.lock();
        for s in &plan.seqs {
            let client =
                self.clients.get_mut(&SeqKey::from_seq_id(s.seq_id).request).expect("scheduled request has a client");
            if client.timings.first_scheduled.is_none() {
                client.timings.first_scheduled = Some(now);
                self.links.queued.fetch_sub(1, Ordering::SeqCst);
                stats.queue_time.observe((now - client.timings.arrived).as_secs_f64());
                stats.prompt_tokens_total += client.prompt_len as u64;
            }
        }
    }

    /// Records every rank's output in its scheduler; the events wait in `undelivered`.
    fn apply_all(&mut self, plans: &[StepPlan], outs: &[StepOutput]) {
        debug_assert!(self.undelivered.is_none(), "a step's events were never delivered");
        self.deliver_undelivered();
        let mut applied = Applied::default();
        for ((sched, plan), out) in self.ranks.iter_mut().zip(plans).zip(outs) {
            let a = sched.apply(plan, out);
            applied.prompt_logprobs.extend(a.prompt_logprobs);
            applied.tokens.extend(a.tokens);
            applied.finished_requests.extend(a.finished_requests);
            applied.rejected.extend(a.rejected);
        }
        let rejected = std::mem::take(&mut applied.rejected);
        self.undelivered = Some((applied, Instant::now()));
        // After the step's other events of the request (its other completions' tokens).
        for (id, why) in rejected {
            self.reject(id, why);
        }
    }

    /// Delivers the pending events of request `id` alone, before something else is sent to it.
    fn deliver_pending_of(&mut self, id: u64) {
        let Some((applied, at)) = self.undelivered.as_mut() else { return };
        if !applied.tokens.iter().any(|t| t.request == id)
            && !applied.finished_requests.contains(&id)
            && !applied.prompt_logprobs.iter().any(|(r, _)| *r == id)
        {
            return;
        }
        let at = *at;
        let (tokens, rest) = std::mem::take(&mut applied.tokens).into_iter().partition(|t| t.request == id);
        applied.tokens = rest;
        let (finished_requests, rest) =
            std::mem::take(&mut applied.finished_requests).into_iter().partition(|&r| r == id);
        applied.finished_requests = rest;
        let (prompt_logprobs, rest) =
            std::mem::take(&mut applied.prompt_logprobs).into_iter().partition(|(r, _)| *r == id);
        applied.prompt_logprobs = rest;
        self.deliver(Applied { prompt_logprobs, tokens, finished_requests, rejected: vec![] }, at);
    }

    fn deliver_undelivered(&mut self) {
        if let Some((applied, at)) = self.undelivered.take() {
            self.deliver(applied, at);
        }
    }

    /// Sends a step's tokens and records their statistics, timed when the step was applied.
    fn deliver(&mut self, applied: Applied, now: Instant) {
        let metrics = self.links.metrics.clone();
        let mut stats = metrics.lock();
        for (id, entries) in applied.prompt_logprobs {
            let client = self.clients.get(&id).expect("request has a client");
            let _ = client.events.send(EngineEvent::PromptLogprobs { entries });
        }
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
            client.completion_tokens[t.index] += 1;
            match t.finish {
                Some(FinishReason::Stop) => stats.finished_stop += 1,
                Some(FinishReason::Length) => stats.finished_length += 1,
                Some(FinishReason::Abort) | None => {}
            }
            if let Some(reason) = t.finish {
                client.completion_ended(reason);
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
            stats.requests.record(&client.finished());
            self.release(&client);
        }
    }

    fn publish(&self) {
        let mut stats = self.links.metrics.lock();
        stats.ranks = self
            .ranks
            .iter()
            .enumerate()
            .map(|(i, s)| RankStats {
                running: s.num_running(),
                waiting: s.num_waiting(),
                kv_usage: s.block_manager().usage(),
                kv_capacity_tokens: s.block_manager().num_blocks() * s.block_manager().block_size(),
                load_tokens: self.links.loads.get(i),
                prefix_cache_queries: s.prefix_cache_stats().queries,
                prefix_cache_hits: s.prefix_cache_stats().hits,
            })
            .collect();
        stats.running = stats.ranks.iter().map(|r| r.running).sum();
        stats.waiting = stats.ranks.iter().map(|r| r.waiting).sum();
        let used: f64 = stats.ranks.iter().map(|r| r.kv_usage * r.kv_capacity_tokens as f64).sum();
        stats.kv_usage = used / stats.kv_capacity_tokens.max(1) as f64;
        stats.preemptions_total = self.ranks.iter().map(Scheduler::preemptions).sum();
        stats.prefix_cache_queries = self.ranks.iter().map(|s| s.prefix_cache_stats().queries).sum();
        stats.prefix_cache_hits = self.ranks.iter().map(|s| s.prefix_cache_stats().hits).sum();
        stats.structured_masks = self.masks;
    }
}
