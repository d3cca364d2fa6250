//! Delivery of a step's events to the clients. A step's outcome is applied as soon as the step
//! ends, but what it delivers waits in the `Outbox` until the next step has been handed to the
//! backend, so that a device running steps on a thread of its own does not wait for this
//! bookkeeping. What a step delivers is fixed when it is applied, and timed then.
//!
//! The outbox goes out whole (`Outbox::flush`) before anything else is applied or the engine
//! waits, or one request's share at a time (`Outbox::flush_request`), which the engine thread
//! calls from one place only (`Worker::with_pending_delivered`): before a command ends or
//! changes a request, so every client sees its events in the order a synchronous engine would
//! send them.

use super::client::Clients;
use crate::api::{EngineEvent, FinishReason, TokenLogprobs};
use crate::metrics::Metrics;
use crate::scheduler::{Applied, Scheduler};
use std::time::Instant;

/// The last step's outcome, applied and not yet delivered, and when it was applied.
pub(super) struct Outbox {
    held: Option<(Applied, Instant)>,
    metrics: Metrics,
}

impl Outbox {
    pub fn new(metrics: Metrics) -> Self {
        Outbox { held: None, metrics }
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_none()
    }

    /// Keeps a step's outcome, applied at `at`, until it is flushed (over whatever was held).
    pub fn hold(&mut self, applied: Applied, at: Instant) {
        self.held = Some((applied, at));
    }

    /// Delivers everything held.
    pub fn flush(&mut self, clients: &mut Clients) {
        if let Some((applied, at)) = self.held.take() {
            deliver(&self.metrics, clients, applied, at);
        }
    }

    /// Delivers the held events of request `id` alone, before something else is sent to it.
    pub fn flush_request(&mut self, id: u64, clients: &mut Clients) {
        let Some((applied, at)) = self.held.as_mut() else { return };
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
        deliver(&self.metrics, clients, Applied { prompt_logprobs, tokens, finished_requests, rejected: vec![] }, at);
    }
}

/// Sends a step's tokens and records their statistics, timed when the step was applied.
fn deliver(metrics: &Metrics, clients: &mut Clients, applied: Applied, now: Instant) {
    let mut stats = metrics.lock();
    for (id, entries) in applied.prompt_logprobs {
        let client = clients.get(id).expect("request has a client");
        let _ = client.events.send(EngineEvent::PromptLogprobs { entries });
    }
    for t in applied.tokens {
        let client = clients.expect_mut(t.request);
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
        let _ =
            client.events.send(EngineEvent::Token { index: t.index, token: t.token.token, logprobs, finish: t.finish });
    }
    for id in applied.finished_requests {
        clients.complete(id, now, &mut stats);
    }
}

/// Tells each request admitted since the last step how much of its prompt the prefix cache held
/// (before any of its tokens, which come after the step).
pub(super) fn announce_admissions(ranks: &mut [Scheduler], clients: &Clients) {
    for rank in ranks {
        for (id, cached_tokens) in rank.take_admitted() {
            if let Some(client) = clients.get(id) {
                let _ = client.events.send(EngineEvent::Admitted { cached_tokens });
            }
        }
    }
}
