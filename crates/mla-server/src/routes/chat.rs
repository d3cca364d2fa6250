//! `POST /v1/chat/completions`.

use super::chat_parsed::{self, ReasoningReport, StreamedChoice};
use super::output::{self, CollectedChoice, Meta, StreamFormat, UsageReporting};
use crate::access_log::AccessRecord;
use crate::error::ApiError;
use crate::extract::JsonObject;
use crate::generate::{ChoiceUpdate, TokenLogprob};
use crate::parsers::{OutputParsing, ToolParserKind};
use crate::prompt_logprobs;
use crate::protocol::chat::*;
use crate::protocol::common::{SamplingWire, UnsupportedWire, Usage, UsageField};
use crate::protocol::extensions::{ChatExtensionsWire, ExtensionsWire, RefusedExtensionsWire};
use crate::protocol::ignored_fields::{field_names, log_ignored};
use crate::protocol::parse_fields;
use crate::state::{blocking, stop_matcher, AppState};
use crate::structured::{self, wire::Requested, Author, StructuredOutput};
use crate::validate::chat_options::chat_prompt_options;
use crate::validate::extensions::{extensions, refuse_extensions};
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
    let mut common: SamplingWire = parse_fields(&body)?;
    state.fill_defaults(&mut common);
    let chat: ChatWire = parse_fields(&body)?;
    let tools = tool_request(
        chat.tools.as_ref(),
        chat.tool_choice.as_ref(),
        chat.parallel_tool_calls.as_ref(),
        chat.functions.as_ref(),
    )?;
    validate::refuse_unsupported(&parse_fields::<UnsupportedWire>(&body)?)?;
    refuse_extensions(&parse_fields::<RefusedExtensionsWire>(&body)?)?;
    let known = [
        field_names::<SamplingWire>(),
        field_names::<ChatWire>(),
        field_names::<UnsupportedWire>(),
        field_names::<structured::wire::StructuredWire>(),
        field_names::<ExtensionsWire>(),
        field_names::<ChatExtensionsWire>(),
        field_names::<RefusedExtensionsWire>(),
    ];
    log_ignored("/v1/chat/completions", &body, &known);
    let ext = extensions(parse_fields(&body)?, state.limits.vocab_size)?;
    let chat_ext: ChatExtensionsWire = parse_fields(&body)?;
    let (parsing, report) = output_parsing(&state, &tools, &chat_ext)?;
    let structured = constraint_of(structured::wire::requested(parse_fields(&body)?)?, &tools)?;
    structured::wire::refuse_with_allowed_tokens(structured.as_ref(), ext.allowed_token_ids.is_some())?;
    state.check_model(common.model.as_deref())?;
    let logprobs = validate::chat_logprobs(chat.logprobs, chat.top_logprobs, &state.limits)?;
    // max_completion_tokens replaced max_tokens in OpenAI's API; the newer field wins.
    let max_tokens = match chat.max_completion_tokens {
        Some(m) => ("max_completion_tokens", Some(m)),
        None => ("max_tokens", common.max_tokens),
    };
    let mut params = validate::validate_params(common, max_tokens, logprobs, &state.defaults, &state.limits)?;
    state.force_usage(&mut params);
    let messages = template_messages(&chat.messages)?;
    let echo = if chat_ext.echo.unwrap_or(false) { echoed_text(&messages) } else { String::new() };
    let mut options = chat_prompt_options(&chat, &messages)?;
    options.tools = tools.tools;

    let grammar = match &structured {
        Some(r) => Some(structured::compile_requested(state.grammars.as_ref(), r).await?),
        None => None,
    };
    let text = state.text.clone();
    let max_model_len = state.limits.max_model_len;
    let stops = params.stop.clone();
    // A prompt to be truncated may be longer than the context: it is cut after tokenizing.
    let tokenize_limit = if ext.truncation.is_some() { usize::MAX } else { max_model_len };
    let (prompt, stop) =
        blocking(move || Ok((text.chat_prompt(&messages, tokenize_limit, &options)?, stop_matcher(stops)?))).await?;
    let prompt = match &ext.truncation {
        Some(t) => t.apply(prompt, max_model_len, params.max_tokens)?,
        None => prompt,
    };
    // Chat reports the prompt's logprobs once, on the response.
    prompt_logprobs::check_response_size(&[prompt.len()], 1, params.prompt_logprobs, None)?;
    let prompt_ids = ext.return_token_ids.then(|| prompt.clone());
    let mut request = state.limits.engine_request(&params, prompt, MaxTokensDefault::RestOfContext, "messages")?;
    // vLLM's rule: without the reasoning in the answer, the reasoning counts as ended, so a
    // constraint governs the reply from its first token.
    match (&grammar, parsing.reasoning.is_some() && report.include) {
        (Some(g), true) => structured::constrain_after_reasoning(&mut request, g),
        (Some(g), false) => structured::constrain(&mut request, g),
        (None, _) => {}
    }
    if let Some(ids) = &ext.allowed_token_ids {
        request.constraint = Some(crate::allowed_tokens::factory(ids, state.limits.vocab_size));
    }
    let mut generation = state.start_generation(vec![request], &params, stop)?;

    let meta = Meta::new("chatcmpl", state.model_name.clone());
    access.describe(&meta.id, params.stream);
    generation.report_to(access);
    // Logprobs would spell out the reasoning left out of the answer (vLLM drops them too).
    let want_logprobs = params.logprobs.is_some() && (report.include || parsing.reasoning.is_none());
    let shape = Shape { parsing, report, want_logprobs, return_token_ids: ext.return_token_ids };
    if params.stream {
        let format = ChatStream { meta, include_usage: params.include_usage, shape, choices: vec![], prompt_ids, echo };
        let usage = UsageReporting { final_chunk: params.include_usage, continuous: params.continuous_usage };
        return Ok(output::stream(generation, format, usage));
    }
    let (choices, usage) = output::collect(generation).await?;
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
        choices: choices.into_iter().enumerate().map(|(index, c)| shape.choice(index, c, &echo)).collect(),
        usage,
        prompt_logprobs,
        prompt_token_ids: prompt_ids,
    };
    Ok(Json(body).into_response())
}

/// vLLM's chat `echo`: the final message's content when the reply continues it (it is the
/// assistant's, the role of the reply), else nothing.
fn echoed_text(messages: &[serde_json::Value]) -> String {
    match messages.last() {
        Some(m) if m.get("role").and_then(|r| r.as_str()) == Some("assistant") => {
            m.get("content").and_then(|c| c.as_str()).unwrap_or_default().to_string()
        }
        _ => String::new(),
    }
}

/// What the request's replies go through: the server's reasoning parser (unless
/// `separate_reasoning: false` keeps the thinking in `content`), its tool-call parser when the
/// request lets the model choose tools (vLLM's rules: "auto" needs both flags, "none" renders
/// the tools but parses nothing), and how the reasoning is reported.
fn output_parsing(
    state: &AppState,
    tools: &ToolRequest,
    ext: &ChatExtensionsWire,
) -> Result<(OutputParsing, ReasoningReport), ApiError> {
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
    let reasoning = state.parsers.reasoning.filter(|_| ext.separate_reasoning.unwrap_or(true));
    let report = ReasoningReport {
        include: ext.include_reasoning.unwrap_or(true),
        stream_pieces: ext.stream_reasoning.unwrap_or(true),
    };
    Ok((OutputParsing { reasoning, tools: tool_parser }, report))
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

/// How this request's choices are reported.
struct Shape {
    parsing: OutputParsing,
    report: ReasoningReport,
    want_logprobs: bool,
    return_token_ids: bool,
}

impl Shape {
    fn choice(&self, index: usize, c: CollectedChoice, echo: &str) -> ChatChoice {
        let (mut message, called) = match self.parsing.is_active() {
            true => chat_parsed::message(&self.parsing, self.report, &c.text),
            false => {
                let message = AssistantMessage {
                    role: "assistant",
                    content: Some(c.text),
                    reasoning: None,
                    reasoning_content: None,
                    tool_calls: vec![],
                };
                (message, false)
            }
        };
        if !echo.is_empty() {
            message.content = Some(format!("{echo}{}", message.content.unwrap_or_default()));
        }
        ChatChoice {
            index,
            message,
            logprobs: self.want_logprobs.then(|| chat_logprobs(c.logprobs)),
            finish_reason: c.finish.map(|f| chat_parsed::finish_reason(f, called)),
            stop_reason: c.stop_reason,
            matched_stop: c.matched_stop,
            token_ids: self.return_token_ids.then_some(c.token_ids),
        }
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
    shape: Shape,
    /// Per choice, when `parsing` is active.
    choices: Vec<StreamedChoice>,
    /// `return_token_ids`: sent with the first chunk.
    prompt_ids: Option<Vec<u32>>,
    /// Chat `echo`: each choice's reply starts with it.
    echo: String,
}

impl ChatStream {
    fn chunk(&mut self, choices: Vec<ChatChunkChoice>, usage: UsageField) -> Bytes {
        let prompt_ids = self.prompt_ids.take();
        self.meta.chunk("chat.completion.chunk", choices, usage, self.include_usage, prompt_ids)
    }
}

impl StreamFormat for ChatStream {
    fn opening(&mut self, num_choices: usize, usage: Option<Usage>) -> Vec<Bytes> {
        if self.shape.parsing.is_active() {
            let (parsing, report) = (self.shape.parsing, self.shape.report);
            self.choices = (0..num_choices).map(|_| StreamedChoice::new(&parsing, report)).collect();
        }
        let usage = usage.map_or(UsageField::Absent, UsageField::Counts);
        let mut chunks = vec![];
        for index in 0..num_choices {
            let delta = Delta { role: Some("assistant"), content: Some(String::new()), ..Default::default() };
            chunks.push(self.chunk(vec![opening_choice(index, delta)], usage));
            // vLLM sends the echoed message as its own chunk after the role.
            if !self.echo.is_empty() {
                let delta = Delta { content: Some(self.echo.clone()), ..Default::default() };
                chunks.push(self.chunk(vec![opening_choice(index, delta)], usage));
            }
        }
        chunks
    }

    fn update(&mut self, u: ChoiceUpdate, usage: Option<Usage>) -> Option<Bytes> {
        let ids = (self.shape.return_token_ids && !u.token_ids.is_empty()).then(|| u.token_ids.clone());
        if u.text.is_empty() && u.logprobs.is_empty() && u.finish.is_none() && ids.is_none() {
            return None;
        }
        let matched_stop = u.matched_stop();
        let (mut deltas, called) = match self.choices.get_mut(u.index) {
            Some(parser) => parser.deltas(&u.text, u.finish.is_some()),
            // Without parsers every chunk has its text, "" when a token's text is held back (it
            // could start a stop string, a character is incomplete) or the chunk only ends the
            // choice, as vLLM sends it: SGLang's clients read every chunk's content as a string.
            None => (vec![Delta { content: Some(u.text), ..Default::default() }], false),
        };
        let want = self.shape.want_logprobs;
        let mut logprobs = (want && !u.logprobs.is_empty()).then(|| chat_logprobs(u.logprobs));
        let mut ids = ids;
        if deltas.is_empty() {
            if logprobs.is_none() && u.finish.is_none() && ids.is_none() {
                return None; // the parser holds the text back for now
            }
            // The parser holds the token's text back, but its logprobs or ids go now, with
            // `content: ""` as above.
            let carries_token = logprobs.is_some() || ids.is_some();
            deltas.push(Delta { content: carries_token.then(String::new), ..Default::default() });
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
            let matched_stop = if k == last { matched_stop.clone() } else { None };
            let c = ChatChunkChoice {
                index: u.index,
                delta,
                logprobs: logprobs.take(),
                finish_reason,
                stop_reason,
                matched_stop,
                token_ids: ids.take(),
            };
            events.extend_from_slice(&self.chunk(vec![c], usage));
        }
        Some(Bytes::from(events))
    }

    fn usage(&mut self, usage: Usage) -> Bytes {
        self.chunk(vec![], UsageField::Counts(usage))
    }
}

fn opening_choice(index: usize, delta: Delta) -> ChatChunkChoice {
    ChatChunkChoice {
        index,
        delta,
        logprobs: None,
        finish_reason: None,
        stop_reason: None,
        matched_stop: None,
        token_ids: None,
    }
}
