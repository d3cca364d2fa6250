//! `POST /v1/chat/completions`.

use super::output::{self, CollectedChoice, StreamFormat};
use crate::access_log::AccessRecord;
use crate::error::ApiError;
use crate::extract::JsonObject;
use crate::generate::{ChoiceUpdate, TokenLogprob};
use crate::protocol::chat::*;
use crate::protocol::common::{SamplingWire, UnsupportedWire, Usage, UsageField};
use crate::protocol::{parse_fields, response_id, unix_now};
use crate::sse;
use crate::state::{blocking, stop_matcher, AppState};
use crate::structured;
use crate::validate::{self, messages::template_messages, MaxTokensDefault};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use std::sync::Arc;

pub async fn handle(
    State(state): State<Arc<AppState>>,
    Extension(access): Extension<AccessRecord>,
    JsonObject(body): JsonObject,
) -> Result<Response, ApiError> {
    let common: SamplingWire = parse_fields(&body)?;
    let chat: ChatWire = parse_fields(&body)?;
    validate::refuse_unsupported(&parse_fields::<UnsupportedWire>(&body)?)?;
    let structured = structured::wire::requested(parse_fields(&body)?)?;
    state.check_model(common.model.as_deref())?;
    let logprobs = validate::chat_logprobs(chat.logprobs, chat.top_logprobs)?;
    // max_completion_tokens replaced max_tokens in OpenAI's API; the newer field wins.
    let max_tokens = match chat.max_completion_tokens {
        Some(m) => ("max_completion_tokens", Some(m)),
        None => ("max_tokens", common.max_tokens),
    };
    let params = validate::validate_params(common, max_tokens, logprobs, &state.defaults, state.limits.vocab_size)?;
    let messages = template_messages(&chat.messages)?;

    let text = state.text.clone();
    let max_model_len = state.limits.max_model_len;
    let stops = params.stop.clone();
    let grammars = state.grammars.clone();
    let (prompt, stop, grammar) = blocking(move || {
        let grammar = structured.map(|r| structured::compile_requested(grammars.as_deref(), &r)).transpose()?;
        Ok((text.chat_prompt(&messages, max_model_len)?, stop_matcher(stops)?, grammar))
    })
    .await?;
    let mut request = state.limits.engine_request(&params, prompt, MaxTokensDefault::RestOfContext, "messages")?;
    if let Some(g) = &grammar {
        structured::constrain(&mut request, g);
    }
    let mut generation = state.start_generation(vec![request], &params, stop)?;

    let meta = Meta { id: response_id("chatcmpl"), created: unix_now(), model: state.model_name.clone() };
    access.describe(&meta.id, params.stream);
    generation.report_to(access);
    if params.stream {
        let format = ChatStream { meta, include_usage: params.include_usage };
        return Ok(output::stream(generation, format, params.include_usage));
    }
    let (choices, usage) = output::collect(generation).await?;
    let want_logprobs = params.logprobs.is_some();
    let body = ChatCompletion {
        id: meta.id,
        object: "chat.completion",
        created: meta.created,
        model: meta.model,
        choices: choices.into_iter().enumerate().map(|(index, c)| choice(index, c, want_logprobs)).collect(),
        usage,
    };
    Ok(Json(body).into_response())
}

struct Meta {
    id: String,
    created: u64,
    model: String,
}

fn choice(index: usize, c: CollectedChoice, want_logprobs: bool) -> ChatChoice {
    ChatChoice {
        index,
        message: AssistantMessage { role: "assistant", content: c.text },
        logprobs: want_logprobs.then(|| chat_logprobs(c.logprobs)),
        finish_reason: c.finish.map(|f| f.as_str()),
    }
}

fn chat_logprobs(tokens: Vec<TokenLogprob>) -> ChatLogprobs {
    ChatLogprobs {
        content: tokens
            .into_iter()
            .map(|t| ChatTokenLogprob {
                token: t.token,
                logprob: t.logprob,
                bytes: t.bytes,
                top_logprobs: t
                    .top
                    .into_iter()
                    .map(|(token, bytes, logprob)| ChatTopLogprob { token, logprob, bytes })
                    .collect(),
            })
            .collect(),
    }
}

struct ChatStream {
    meta: Meta,
    include_usage: bool,
}

impl ChatStream {
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: UsageField) -> Bytes {
        let usage = match (self.include_usage, usage) {
            (false, _) => UsageField::Absent,
            (true, UsageField::Absent) => UsageField::Null,
            (true, u) => u,
        };
        sse::data_event(&ChatChunk {
            id: self.meta.id.clone(),
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: self.meta.model.clone(),
            choices,
            usage,
        })
    }
}

impl StreamFormat for ChatStream {
    fn opening(&mut self, num_choices: usize) -> Vec<Bytes> {
        (0..num_choices)
            .map(|index| {
                let delta = Delta { role: Some("assistant"), content: Some(String::new()) };
                self.chunk(
                    vec![ChatChunkChoice { index, delta, logprobs: None, finish_reason: None }],
                    UsageField::Absent,
                )
            })
            .collect()
    }

    fn update(&mut self, u: ChoiceUpdate) -> Option<Bytes> {
        if u.text.is_empty() && u.logprobs.is_empty() && u.finish.is_none() {
            return None;
        }
        let delta = Delta { role: None, content: (!u.text.is_empty()).then_some(u.text) };
        let logprobs = (!u.logprobs.is_empty()).then(|| chat_logprobs(u.logprobs));
        let c = ChatChunkChoice { index: u.index, delta, logprobs, finish_reason: u.finish.map(|f| f.as_str()) };
        Some(self.chunk(vec![c], UsageField::Absent))
    }

    fn usage(&mut self, usage: Usage) -> Bytes {
        self.chunk(vec![], UsageField::Counts(usage))
    }
}
