//! The engine thread's record of each request it serves (`Client`: the link to its client, its
//! timings, how its completions ended) and the accounting when a request starts to run or
//! leaves (`Clients`): it comes off the queued count when it first runs, or when it leaves
//! without having run, comes off its rank's load, and the statistics record it. Every way a
//! request ends (completed, aborted, failed, rejected) goes through `Clients::forget`, so none
//! of them can forget a count.

use super::rank_loads::{request_cost, RankLoads};
use crate::api::{EngineEvent, FinishReason, GenerateRequest, RequestTimings};
use crate::id_map::IdMap;
use crate::request_stats::FinishedRequest;
use crate::sequence::SeqKey;
use crate::stats::EngineStats;
use mla_core::step::plan::StepPlan;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A request's link to its client, and its timings.
pub(super) struct Client {
    pub events: UnboundedSender<EngineEvent>,
    pub timings: RequestTimings,
    pub wants_logprobs: bool,
    prompt_len: usize,
    /// When each completion last produced a token (inter-token latency).
    pub last_token: Vec<Option<Instant>>,
    /// Tokens each completion produced, and the cap on them.
    pub completion_tokens: Vec<usize>,
    max_tokens: usize,
    /// How the request ends if nothing worse happens to it: see `worse`.
    reason: FinishReason,
    /// The attention rank serving it, and what it adds to that rank's load.
    rank: usize,
    cost: u64,
}

impl Client {
    /// The client of `req`, which arrived at `arrived` and was routed to `rank` (the handle
    /// counted it on that rank's load already).
    pub fn new(events: UnboundedSender<EngineEvent>, req: &GenerateRequest, arrived: Instant, rank: usize) -> Self {
        Client {
            events,
            timings: RequestTimings { arrived, first_scheduled: None, first_token: None, finished: None },
            wants_logprobs: req.logprobs.is_some(),
            prompt_len: req.prompt_tokens.len(),
            last_token: vec![None; req.n],
            completion_tokens: vec![0; req.n],
            max_tokens: req.max_tokens,
            reason: FinishReason::Stop,
            rank,
            cost: request_cost(req),
        }
    }

    /// Notes how one of its completions ended.
    pub fn completion_ended(&mut self, reason: FinishReason) {
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

/// The clients of the requests an engine thread serves, by request id, and the counts shared
/// with the handle that their comings and goings move.
pub(super) struct Clients {
    map: IdMap<Client>,
    /// Requests submitted and not yet scheduled (the `max_queued_requests` count).
    queued: Arc<AtomicUsize>,
    /// Work each rank has taken on.
    loads: Arc<RankLoads>,
}

impl Clients {
    pub fn new(queued: Arc<AtomicUsize>, loads: Arc<RankLoads>) -> Self {
        Clients { map: IdMap::default(), queued, loads }
    }

    pub fn insert(&mut self, id: u64, client: Client) {
        self.map.insert(id, client);
    }

    pub fn get(&self, id: u64) -> Option<&Client> {
        self.map.get(&id)
    }

    /// The client of a request that has one by construction (it is scheduled, or has events
    /// pending).
    pub fn expect_mut(&mut self, id: u64) -> &mut Client {
        self.map.get_mut(&id).expect("every scheduled request has a client")
    }

    /// The attention rank serving request `id`, if it is still here.
    pub fn rank_of(&self, id: u64) -> Option<usize> {
        self.map.get(&id).map(|c| c.rank)
    }

    pub fn ids(&self) -> Vec<u64> {
        self.map.keys().copied().collect()
    }

    /// Requests whose client went away (it dropped its receiver).
    pub fn departed(&self) -> Vec<u64> {
        self.map.iter().filter(|(_, c)| c.events.is_closed()).map(|(&id, _)| id).collect()
    }

    /// Notes the requests of `plan` that run for the first time: they leave the queue.
    pub fn mark_scheduled(&mut self, plan: &StepPlan, stats: &mut EngineStats) {
        // Decode rows only feed sequences that were prefilled, so scheduled, before.
        let (prompt_chunks, _) = plan.split();
        if prompt_chunks.is_empty() {
            return;
        }
        let now = Instant::now();
        for s in prompt_chunks {
            let request = SeqKey::from_seq_id(s.seq_id).request;
            let client = self.map.get_mut(&request).expect("scheduled request has a client");
            if client.timings.first_scheduled.is_none() {
                client.timings.first_scheduled = Some(now);
                self.queued.fetch_sub(1, Ordering::SeqCst);
                stats.queue_time.observe((now - client.timings.arrived).as_secs_f64());
                stats.prompt_tokens_total += client.prompt_len as u64;
            }
        }
    }

    /// Ends request `id`, every completion of which finished, at `now`: it gets an end-to-end
    /// latency, unlike a request cut short.
    pub fn complete(&mut self, id: u64, now: Instant, stats: &mut EngineStats) {
        let client = self.forget(id);
        stats.e2e_latency.observe((now - client.timings.arrived).as_secs_f64());
        stats.requests.record(&client.finished());
    }

    /// Ends request `id` before its completions did (aborted, failed or rejected): it counts as
    /// aborted. The client is returned for its last words.
    pub fn cut_short(&mut self, id: u64, stats: &mut EngineStats) -> Client {
        let mut client = self.forget(id);
        client.completion_ended(FinishReason::Abort);
        stats.requests.record(&client.finished());
        client
    }

    /// Removes a request's client and takes its cost off its rank's load (and it off the queued
    /// count if it never ran).
    fn forget(&mut self, id: u64) -> Client {
        let client = self.map.remove(&id).expect("every scheduled request has a client");
        if client.timings.first_scheduled.is_none() {
            self.queued.fetch_sub(1, Ordering::SeqCst);
        }
        self.loads.release(client.rank, client.cost);
        client
    }
}
