//! `POST /v1/completions`.

use super::output::{self, CollectedChoice, StreamFormat};
use crate::access_log::AccessRecord;
use crate::error::ApiError;
use crate::extract::JsonObject;
use crate::generate::{ChoiceUpdate, TokenLogprob};
use crate::protocol::common::{SamplingWire, UnsupportedWire, Usage, UsageField};
use crate::protocol::completions::*;
use crate::protocol::{parse_fields, response_id, unix_now};
use crate::sse;
use crate::state::{blocking, stop_matcher, AppState};
use crate::structured;
use crate::validate::prompt::{prompt_inputs, PromptInput};
use crate::validate::{self, MaxTokensDefault};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::Value;
use std::sync::Arc;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: usize = 16;

pub async fn handle(
    State(state): State<Arc<AppState>>,
    Extension(access): Extension<AccessRecord>,
    JsonObject(body): JsonObject,
) -> Result<Response, ApiError> {
    let common: SamplingWire = parse_fields(&body)?;
    let wire: CompletionWire = parse_fields(&body).map_err(|e| explain_prompt_error(e, &body))?;
    validate::refuse_unsupported(&parse_fields::<UnsupportedWire>(&body)?)?;
    let structured = structured::wire::requested(parse_fields(&body)?)?;
    state.check_model(common.model.as_deref())?;
    let logprobs = validate::completion_logprobs(wire.logprobs)?;
    let echo = wire.echo.unwrap_or(false);
    if echo && logprobs.is_some() {
        // That combination asks for prompt logprobs, which the engine does not compute.
        return Err(ApiError::invalid("echo", "echo together with logprobs (prompt logprobs) is not supported"));
    }
    let max_tokens = ("max_tokens", common.max_tokens);
    let params = validate::validate_params(common, max_tokens, logprobs, &state.defaults, state.limits.vocab_size)?;
    let inputs = prompt_inputs(wire.prompt, state.limits.vocab_size)?;
    state.check_batch_shape(inputs.len(), params.n)?;

    let text = state.text.clone();
    let max_model_len = state.limits.max_model_len;
    let single = inputs.len() == 1;
    let stops = params.stop.clone();
    let grammars = state.grammars.clone();
    let (prompts, stop, grammar) = blocking(move || {
        // One compilation serves every prompt and every completion of the request.
        let grammar = structured.map(|r| structured::compile_requested(grammars.as_deref(), &r)).transpose()?;
        let prompts = inputs
            .into_iter()
            .enumerate()
            .map(|(i, p)| match p {
                PromptInput::Text(s) => Ok((text.encode_prompt(&s, max_model_len, &prompt_field(single, i))?, s)),
                PromptInput::Tokens(ids) => {
                    let echo_text = if echo { text.decode(&ids, false)? } else { String::new() };
                    Ok((ids, echo_text))
                }
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        Ok((prompts, stop_matcher(stops)?, grammar))
    })
    .await?;
    let mut requests = Vec::with_capacity(prompts.len());
    let mut echoes = Vec::new();
    for (i, (tokens, prompt_text)) in prompts.into_iter().enumerate() {
        let field = prompt_field(single, i);
        let mut request =
            state.limits.engine_request(&params, tokens, MaxTokensDefault::Fixed(DEFAULT_MAX_TOKENS), &field)?;
        if let Some(g) = &grammar {
            structured::constrain(&mut request, g);
        }
        requests.push(request);
        // Choices are numbered prompt-major: prompt i owns choices i*n .. (i+1)*n.
        echoes.extend(std::iter::repeat_n(if echo { prompt_text } else { String::new() }, params.n));
    }
    let mut generation = state.start_generation(requests, &params, stop)?;

    let meta = Meta { id: response_id("cmpl"), created: unix_now(), model: state.model_name.clone() };
    access.describe(&meta.id, params.stream);
    generation.report_to(access);
    let want_logprobs = params.logprobs.is_some();
    if params.stream {
        let offsets = echoes.iter().map(|e| e.chars().count()).collect();
        let format = CompletionStream { meta, include_usage: params.include_usage, echoes, offsets, want_logprobs };
        return Ok(output::stream(generation, format, params.include_usage));
    }
    let (choices, usage) = output::collect(generation).await?;
    let choices = choices
        .into_iter()
        .zip(echoes)
        .enumerate()
        .map(|(index, (c, echo_text))| choice(index, c, echo_text, want_logprobs))
        .collect();
    let body =
        Completion { id: meta.id, object: "text_completion", created: meta.created, model: meta.model, choices, usage };
    Ok(Json(body).into_response())
}

/// How errors name prompt `i`: `prompt` alone, or `prompt[i]` in a list.
fn prompt_field(single: bool, i: usize) -> String {
    if single {
        "prompt".to_string()
    } else {
        format!("prompt[{i}]")
    }
}

/// serde's message for an untagged enum says nothing useful; say what `prompt` may be.
fn explain_prompt_error(e: ApiError, body: &Value) -> ApiError {
    match &e {
        ApiError::InvalidJson { param: Some(p), .. } if p == "prompt" && body.get("prompt").is_some() => {
            ApiError::InvalidJson {
                message:
                    "prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
                        .into(),
                param: Some("prompt".into()),
            }
        }
        _ => e,
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
}

fn choice(index: usize, c: CollectedChoice, echo: String, want_logprobs: bool) -> CompletionChoice {
    let offset = echo.chars().count();
    CompletionChoice {
        index,
        logprobs: want_logprobs.then(|| legacy_logprobs(&c.logprobs, &mut offset.clone())),
        text: echo + &c.text,
        finish_reason: c.finish.map(|f| f.as_str()),
    }
}

/// The legacy parallel-list form; `offset` is advanced past the tokens (character offsets into
/// the choice's text, as OpenAI counts them).
fn legacy_logprobs(tokens: &[TokenLogprob], offset: &mut usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for t in tokens {
        out.tokens.push(t.token.clone());
        out.token_logprobs.push(t.logprob);
        out.top_logprobs.push(t.top.iter().map(|(s, _, lp)| (s.clone(), *lp)).collect());
        out.text_offset.push(*offset);
        *offset += t.token.chars().count();
    }
    out
}

struct CompletionStream {
    meta: Meta,
    include_usage: bool,
    /// Prompt text each choice starts with (empty without `echo`); sent first.
    echoes: Vec<String>,
    /// Character offset of the next token in each choice's text.
    offsets: Vec<usize>,
    want_logprobs: bool,
}

impl CompletionStream {
    fn chunk(&self, choices: Vec<CompletionChoice>, usage: UsageField) -> Bytes {
        let usage = match (self.include_usage, usage) {
            (false, _) => UsageField::Absent,
            (true, UsageField::Absent) => UsageField::Null,
            (true, u) => u,
        };
        sse::data_event(&CompletionChunk {
            id: self.meta.id.clone(),
            object: "text_completion",
            created: self.meta.created,
            model: self.meta.model.clone(),
            choices,
            usage,
        })
    }
}

impl StreamFormat for CompletionStream {
    fn opening(&mut self, _num_choices: usize) -> Vec<Bytes> {
        let echoes = std::mem::take(&mut self.echoes);
        echoes
            .into_iter()
            .enumerate()
            .filter(|(_, e)| !e.is_empty())
            .map(|(index, text)| {
                let c = CompletionChoice { index, text, logprobs: None, finish_reason: None };
                self.chunk(vec![c], UsageField::Absent)
            })
            .collect()
    }

    fn update(&mut self, u: ChoiceUpdate) -> Option<Bytes> {
        if u.text.is_empty() && u.logprobs.is_empty() && u.finish.is_none() {
            return None;
        }
        let logprobs = (self.want_logprobs && !u.logprobs.is_empty())
            .then(|| legacy_logprobs(&u.logprobs, &mut self.offsets[u.index]));
        let c =
            CompletionChoice { index: u.index, text: u.text, logprobs, finish_reason: u.finish.map(|f| f.as_str()) };
        Some(self.chunk(vec![c], UsageField::Absent))
    }

    fn usage(&mut self, usage: Usage) -> Bytes {
        self.chunk(vec![], UsageField::Counts(usage))
    }
}
