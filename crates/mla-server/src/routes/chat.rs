//! `POST /v1/chat/completions`.

use super::chat_parsed::{self, StreamedChoice};
use super::output::{self, CollectedChoice, StreamFormat, UsageReporting};
use crate::access_log::AccessRecord;
use crate::error::ApiError;
use crate::extract::JsonObject;
use crate::generate::{ChoiceUpdate, TokenLogprob};
use crate::parsers::{OutputParsing, ToolParserKind};
use crate::prompt_logprobs;
use crate::protocol::chat::*;
use crate::protocol::common::{SamplingWire, UnsupportedWire, Usage, UsageField};
use crate::protocol::ignored_fields::{field_names, log_ignored};
use crate::protocol::{parse_fields, response_id, unix_now};
use crate::sse;
use crate::state::{blocking, stop_matcher, AppState};
use crate::structured::{self, wire::Requested, Author, StructuredOutput};
use crate::validate::chat_options::chat_prompt_options;
use crate::validate::tools::{tool_request, ToolChoice, ToolRequest};
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
    let tools = tool_request(
        chat.tools.as_ref(),
        chat.tool_choice.as_ref(),
        chat.parallel_tool_calls.as_ref(),
        chat.functions.as_ref(),
    )?;
    validate::refuse_unsupported(&parse_fields::<UnsupportedWire>(&body)?)?;
    let known = [
        field_names::<SamplingWire>(),
        field_names::<ChatWire>(),
        field_names::<UnsupportedWire>(),
        field_names::<structured::wire::StructuredWire>(),
    ];
    log_ignored("/v1/chat/completions", &body, &known);
    let parsing = output_parsing(&state, &tools)?;
    let structured = constraint_of(structured::wire::requested(parse_fields(&body)?)?, &tools)?;
    state.check_model(common.model.as_deref())?;
    let logprobs = validate::chat_logprobs(chat.logprobs, chat.top_logprobs)?;
    // max_completion_tokens replaced max_tokens in OpenAI's API; the newer field wins.
    let max_tokens = match chat.max_completion_tokens {
        Some(m) => ("max_completion_tokens", Some(m)),
        None => ("max_tokens", common.max_tokens),
    };
    let params = validate::validate_params(common, max_tokens, logprobs, &state.defaults, state.limits.vocab_size)?;
    let messages = template_messages(&chat.messages)?;
    let mut options = chat_prompt_options(&chat, &messages)?;
    options.tools = tools.tools;

    let grammar = match &structured {
        Some(r) => Some(structured::compile_requested(state.grammars.as_ref(), r).await?),
        None => None,
    };
    let text = state.text.clone();
    let max_model_len = state.limits.max_model_len;
    let stops = params.stop.clone();
    let (prompt, stop) =
        blocking(move || Ok((text.chat_prompt(&messages, max_model_len, &options)?, stop_matcher(stops)?))).await?;
    // Chat reports the prompt's logprobs once, on the response.
    prompt_logprobs::check_response_size(&[prompt.len()], 1, params.prompt_logprobs, None)?;
    let mut request = state.limits.engine_request(&params, prompt, MaxTokensDefault::RestOfContext, "messages")?;
    match (&grammar, parsing.reasoning.is_some()) {
        (Some(g), true) => structured::constrain_after_reasoning(&mut request, g),
        (Some(g), false) => structured::constrain(&mut request, g),
        (None, _) => {}
    }
    let mut generation = state.start_generation(vec![request], &params, stop)?;

    let meta = Meta { id: response_id("chatcmpl"), created: unix_now(), model: state.model_name.clone() };
    access.describe(&meta.id, params.stream);
    generation.report_to(access);
    if params.stream {
        let format = ChatStream { meta, include_usage: params.include_usage, parsing, choices: vec![] };
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
        choices: choices.into_iter().enumerate().map(|(index, c)| choice(index, c, want_logprobs, &parsing)).collect(),
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

/// What the request's replies go through: the server's reasoning parser, and its tool-call
/// parser when the request lets the model choose tools (vLLM's rules: "auto" needs both flags,
/// "none" renders the tools but parses nothing).
fn output_parsing(state: &AppState, tools: &ToolRequest) -> Result<OutputParsing, ApiError> {
    let tool_parser = match (&tools.choice, state.parsers.enable_auto_tool_choice, state.parsers.tool_call) {
        (ToolChoice::None, _, _) => None,
        (ToolChoice::Auto, true, Some(kind)) => Some((kind, (!tools.parallel).then_some(1))),
        (ToolChoice::Auto, _, _) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
            ))
        }
        // "required" and named choices force a call: `constraint_of` constrains decoding to the
        // DeepSeek-V3 call format, so the reply is parsed with the V3 parser whatever
        // --tool-call-parser says (vLLM needs no parser flag for these either).
        (ToolChoice::Required | ToolChoice::Named(_), _, _) => {
            Some((ToolParserKind::DeepSeekV3, (!tools.parallel).then_some(1)))
        }
    };
    Ok(OutputParsing { reasoning: state.parsers.reasoning, tools: tool_parser })
}

/// The request's one decoding constraint: its structured-output fields, or the grammar that a
/// "required" or named `tool_choice` forces (one or more calls in DeepSeek-V3's format whose
/// arguments validate against the tools' schemas, `validate::tools`). Both at once is a 400, as
/// any two constraints are.
fn constraint_of(requested: Option<Requested>, tools: &ToolRequest) -> Result<Option<Requested>, ApiError> {
    let forced = tools.forced_call_grammar().map(|g| Requested {
        output: StructuredOutput::Lark(g),
        field: "tool_choice".to_string(),
        author: Author::Server,
    });
    match (requested, forced) {
        (Some(r), Some(_)) => Err(ApiError::invalid(
            &r.field,
            format!(
                "{} cannot be combined with a \"required\" or named tool_choice: both constrain the reply",
                r.field
            ),
        )),
        (r, f) => Ok(r.or(f)),
    }
}

fn choice(index: usize, c: CollectedChoice, want_logprobs: bool, parsing: &OutputParsing) -> ChatChoice {
    let (message, called) = match parsing.is_active() {
        true => chat_parsed::message(parsing, &c.text),
        false => {
            let message = AssistantMessage {
                role: "assistant",
                content: Some(c.text),
                reasoning_content: None,
                tool_calls: vec![],
            };
            (message, false)
        }
    };
    ChatChoice {
        index,
        message,
        logprobs: want_logprobs.then(|| chat_logprobs(c.logprobs)),
        finish_reason: c.finish.map(|f| chat_parsed::finish_reason(f, called)),
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
    parsing: OutputParsing,
    /// Per choice, when `parsing` is active.
    choices: Vec<StreamedChoice>,
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
        if self.parsing.is_active() {
            self.choices = (0..num_choices).map(|_| StreamedChoice::new(&self.parsing)).collect();
        }
        (0..num_choices)
            .map(|index| {
                let delta = Delta { role: Some("assistant"), content: Some(String::new()), ..Default::default() };
                let c = ChatChunkChoice { index, delta, logprobs: None, finish_reason: None, stop_reason: None };
                self.chunk(vec![c], usage.map_or(UsageField::Absent, UsageField::Counts))
            })
            .collect()
    }

    fn update(&mut self, u: ChoiceUpdate, usage: Option<Usage>) -> Option<Bytes> {
        if u.text.is_empty() && u.logprobs.is_empty() && u.finish.is_none() {
            return None;
        }
        let (mut deltas, called) = match self.choices.get_mut(u.index) {
            Some(parser) => parser.deltas(&u.text, u.finish.is_some()),
            None => (vec![Delta { content: (!u.text.is_empty()).then_some(u.text), ..Default::default() }], false),
        };
        let mut logprobs = (!u.logprobs.is_empty()).then(|| chat_logprobs(u.logprobs));
        if deltas.is_empty() {
            if logprobs.is_none() && u.finish.is_none() {
                return None; // the parser holds the text back for now
            }
            deltas.push(Delta::default());
        }
        // Several deltas (reasoning, content, tool calls) go out as consecutive events; the
        // first carries the token logprobs, the last the finish and stop reasons.
        let last = deltas.len() - 1;
        let usage = usage.map_or(UsageField::Absent, UsageField::Counts);
        let mut events = Vec::new();
        for (k, delta) in deltas.into_iter().enumerate() {
            let finish_reason =
                (k == last).then_some(u.finish).flatten().map(|f| chat_parsed::finish_reason(f, called));
            let stop_reason = if k == last { u.stop_reason.clone() } else { None };
            let c = ChatChunkChoice { index: u.index, delta, logprobs: logprobs.take(), finish_reason, stop_reason };
            events.extend_from_slice(&self.chunk(vec![c], usage));
        }
        Some(Bytes::from(events))
    }

    fn usage(&mut self, usage: Usage) -> Bytes {
        self.chunk(vec![], UsageField::Counts(usage))
    }
}
