//! `POST /v1/chat/completions`.

use super::output::{self, CollectedChoice, StreamFormat, UsageReporting};
use crate::access_log::AccessRecord;
use crate::error::ApiError;
use crate::extract::JsonObject;
use crate::generate::{ChoiceUpdate, TokenLogprob};
use crate::prompt_logprobs;
use crate::protocol::chat::*;
use crate::protocol::common::{SamplingWire, UnsupportedWire, Usage, UsageField};
use crate::protocol::ignored_fields::{field_names, log_ignored};
use crate::protocol::{parse_fields, response_id, unix_now};
use crate::sse;
use crate::state::{blocking, stop_matcher, AppState};
use crate::validate::chat_options::chat_prompt_options;
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
    let known = [field_names::<SamplingWire>(), field_names::<ChatWire>(), field_names::<UnsupportedWire>()];
    log_ignored("/v1/chat/completions", &body, &known);
    state.check_model(common.model.as_deref())?;
    let logprobs = validate::chat_logprobs(chat.logprobs, chat.top_logprobs)?;
    // max_completion_tokens replaced max_tokens in OpenAI's API; the newer field wins.
    let max_tokens = match chat.max_completion_tokens {
        Some(m) => ("max_completion_tokens", Some(m)),
        None => ("max_tokens", common.max_tokens),
    };
    let params = validate::validate_params(common, max_tokens, logprobs, &state.defaults, state.limits.vocab_size)?;
    let messages = template_messages(&chat.messages)?;
    let options = chat_prompt_options(&chat, &messages)?;

    let text = state.text.clone();
    let max_model_len = state.limits.max_model_len;
    let stops = params.stop.clone();
    let (prompt, stop) =
        blocking(move || Ok((text.chat_prompt(&messages, max_model_len, &options)?, stop_matcher(stops)?))).await?;
    let request = state.limits.engine_request(&params, prompt, MaxTokensDefault::RestOfContext, "messages")?;
    let mut generation = state.start_generation(vec![request], &params, stop)?;

    let meta = Meta { id: response_id("chatcmpl"), created: unix_now(), model: state.model_name.clone() };
    access.describe(&meta.id, params.stream);
    generation.report_to(access);
    if params.stream {
        let format = ChatStream { meta, include_usage: params.include_usage };
        let usage = UsageReporting { final_chunk: params.include_usage, continuous: params.continuous_usage };
        return Ok(output::stream(generation, format, usage));
    }
    let (choices, usage) = output::collect(generation).await?;
    let want_logprobs = params.logprobs.is_some();
    // One prompt: every choice carries the same prompt logprobs.
    let prompt_logprobs = params.prompt_logprobs.and_then(|k| {
        let entries = choices.iter().find_map(|c| c.prompt_logprobs.clone())?;
        Some(prompt_logprobs::vllm_list(&state.text, &entries, k))
    });
    let body = ChatCompletion {
        id: meta.id,
        object: "chat.completion",
        created: meta.created,
        model: meta.model,
        choices: choices.into_iter().enumerate().map(|(index, c)| choice(index, c, want_logprobs)).collect(),
        usage,
        prompt_logprobs,
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
        stop_reason: c.stop_reason,
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
    fn opening(&mut self, num_choices: usize, usage: Option<Usage>) -> Vec<Bytes> {
        (0..num_choices)
            .map(|index| {
                let delta = Delta { role: Some("assistant"), content: Some(String::new()) };
                let c = ChatChunkChoice { index, delta, logprobs: None, finish_reason: None, stop_reason: None };
                self.chunk(vec![c], usage.map_or(UsageField::Absent, UsageField::Counts))
            })
            .collect()
    }

    fn update(&mut self, u: ChoiceUpdate, usage: Option<Usage>) -> Option<Bytes> {
        if u.text.is_empty() && u.logprobs.is_empty() && u.finish.is_none() {
            return None;
        }
        let delta = Delta { role: None, content: (!u.text.is_empty()).then_some(u.text) };
        let logprobs = (!u.logprobs.is_empty()).then(|| chat_logprobs(u.logprobs));
        let c = ChatChunkChoice {
            index: u.index,
            delta,
            logprobs,
            finish_reason: u.finish.map(|f| f.as_str()),
            stop_reason: u.stop_reason,
        };
        Some(self.chunk(vec![c], usage.map_or(UsageField::Absent, UsageField::Counts)))
    }

    fn usage(&mut self, usage: Usage) -> Bytes {
        self.chunk(vec![], UsageField::Counts(usage))
    }
}
