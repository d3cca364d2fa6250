//! Turning a `Generation` into either a whole response (collected) or an SSE stream, shared by
//! both endpoints; the endpoint supplies only the chunk shapes (`StreamFormat`).

use crate::error::ApiError;
use crate::generate::{ChoiceUpdate, Generation, TokenLogprob};
use crate::protocol::common::{StopReason, StreamChunk, Usage, UsageField};
use crate::protocol::{response_id, unix_now};
use crate::sse;
use axum::body::Bytes;
use axum::response::Response;
use mla_engine::{FinishReason, PromptTokenLogprob};
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::Arc;

/// One choice after generation ended.
#[derive(Debug, Clone, Default)]
pub struct CollectedChoice {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
    /// SGLang's `matched_stop`.
    pub matched_stop: Option<StopReason>,
    /// Every generated id, for `return_token_ids`.
    pub token_ids: Vec<u32>,
    /// The prompt's logprobs when they were asked for.
    pub prompt_logprobs: Option<Arc<Vec<PromptTokenLogprob>>>,
}

/// Runs the generation to the end. An engine error fails the whole request.
pub async fn collect(mut generation: Generation) -> Result<(Vec<CollectedChoice>, Usage), ApiError> {
    let mut choices = vec![CollectedChoice::default(); generation.num_choices()];
    while let Some(update) = generation.next().await {
        let u = update?;
        let matched_stop = u.matched_stop();
        let c = &mut choices[u.index];
        c.text.push_str(&u.text);
        c.logprobs.extend(u.logprobs);
        c.token_ids.extend(&u.token_ids);
        if u.finish.is_some() {
            c.matched_stop = matched_stop;
            c.finish = u.finish;
            c.stop_reason = u.stop_reason;
        }
        if u.prompt_logprobs.is_some() {
            c.prompt_logprobs = u.prompt_logprobs;
        }
    }
    Ok((choices, generation.usage()))
}

/// Who a response is: its id, when it was created and the model's name, the same on the whole
/// response and on every chunk of its stream.
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Meta {
    /// A new response, its id `prefix-` and random hex.
    pub fn new(prefix: &str, model: String) -> Self {
        Meta { id: response_id(prefix), created: unix_now(), model }
    }

    /// One stream chunk of this response, of kind `object`, as an SSE event; `usage` as
    /// `UsageField::in_stream` sends it.
    pub fn chunk<C: Serialize>(
        &self,
        object: &'static str,
        choices: Vec<C>,
        usage: UsageField,
        include_usage: bool,
        prompt_token_ids: Option<Vec<u32>>,
    ) -> Bytes {
        sse::data_event(&StreamChunk {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: usage.in_stream(include_usage),
            prompt_token_ids,
        })
    }
}

/// The chunk shapes of one endpoint's stream. `usage` is the usage so far, given only when the
/// client asked for it on every chunk (`stream_options.continuous_usage_stats`).
pub trait StreamFormat: Send + 'static {
    /// Chunks sent before any token (chat: one role chunk per choice; completions: echo).
    fn opening(&mut self, num_choices: usize, usage: Option<Usage>) -> Vec<Bytes>;
    /// The chunk for one update, or nothing when it carries nothing.
    fn update(&mut self, u: ChoiceUpdate, usage: Option<Usage>) -> Option<Bytes>;
    /// The final usage chunk (`choices: []`), sent only when the client asked for it.
    fn usage(&mut self, usage: Usage) -> Bytes;
}

/// Which usage a stream reports.
#[derive(Debug, Clone, Copy)]
pub struct UsageReporting {
    /// The final usage chunk (`stream_options.include_usage`).
    pub final_chunk: bool,
    /// The usage so far on every chunk (`stream_options.continuous_usage_stats`).
    pub continuous: bool,
}

struct StreamState<F> {
    generation: Generation,
    format: F,
    include_usage: bool,
    continuous_usage: bool,
    queue: VecDeque<Bytes>,
    ended: bool,
}

/// Streams the generation as SSE: opening chunks, one chunk per update, the usage chunk when
/// asked, then `[DONE]`; an engine error becomes an error event before `[DONE]`.
/// The response body owns the generation: a client that disconnects drops it, aborting the
/// engine requests.
pub fn stream<F: StreamFormat>(generation: Generation, mut format: F, usage: UsageReporting) -> Response {
    let so_far = usage.continuous.then(|| generation.usage());
    let queue = format.opening(generation.num_choices(), so_far).into();
    let state = StreamState {
        generation,
        format,
        include_usage: usage.final_chunk,
        continuous_usage: usage.continuous,
        queue,
        ended: false,
    };
    let events = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(b) = s.queue.pop_front() {
                return Some((b, s));
            }
            if s.ended {
                return None;
            }
            match s.generation.next().await {
                Some(Ok(u)) => {
                    let so_far = s.continuous_usage.then(|| s.generation.usage());
                    s.queue.extend(s.format.update(u, so_far))
                }
                Some(Err(e)) => {
                    s.queue.push_back(sse::error_event(&e));
                    s.queue.push_back(sse::done_event());
                    s.ended = true;
                }
                None => {
                    if s.include_usage {
                        let usage = s.generation.usage();
                        s.queue.push_back(s.format.usage(usage));
                    }
                    s.queue.push_back(sse::done_event());
                    s.ended = true;
                }
            }
        }
    });
    sse::response(events)
}
