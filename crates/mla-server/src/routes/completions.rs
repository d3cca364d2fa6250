//! `POST /v1/completions`.

use super::output::{self, CollectedChoice, Meta, StreamFormat, UsageReporting};
use crate::access_log::AccessRecord;
use crate::error::ApiError;
use crate::extract::JsonObject;
use crate::generate::{ChoiceUpdate, TokenLogprob};
use crate::prompt_logprobs::{self, LegacyEntry};
use crate::protocol::common::{PromptLogprobsWire, SamplingWire, TopLogprobsWire, UnsupportedWire, Usage, UsageField};
use crate::protocol::completions::*;
use crate::protocol::extensions::{ExtensionsWire, RefusedExtensionsWire};
use crate::protocol::ignored_fields::{field_names, log_ignored};
use crate::protocol::parse_fields;
use crate::state::{blocking, stop_matcher, AppState};
use crate::structured;
use crate::text::TextPipeline;
use crate::validate::extensions::{extensions, refuse_extensions};
use crate::validate::prompt::{prompt_inputs, PromptInput};
use crate::validate::{self, MaxTokensDefault};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use mla_engine::{FinishReason, PromptTokenLogprob};
use serde_json::Value;
use std::sync::Arc;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: usize = 16;

pub async fn handle(
    State(state): State<Arc<AppState>>,
    Extension(access): Extension<AccessRecord>,
    JsonObject(body): JsonObject,
) -> Result<Response, ApiError> {
    let mut common: SamplingWire = parse_fields(&body)?;
    state.fill_defaults(&mut common);
    let wire: CompletionWire = parse_fields(&body).map_err(|e| explain_prompt_error(e, &body))?;
    // Both read before either refuses, so a mistyped field still answers before a refused value.
    let unsupported: UnsupportedWire = parse_fields(&body)?;
    let tool_fields: ToolFieldsWire = parse_fields(&body)?;
    validate::refuse_unsupported(&unsupported)?;
    validate::refuse_tools(&tool_fields)?;
    refuse_extensions(&parse_fields::<RefusedExtensionsWire>(&body)?)?;
    let known = [
        field_names::<SamplingWire>(),
        field_names::<CompletionWire>(),
        field_names::<UnsupportedWire>(),
        field_names::<ToolFieldsWire>(),
        field_names::<structured::wire::StructuredWire>(),
        field_names::<ExtensionsWire>(),
        field_names::<RefusedExtensionsWire>(),
    ];
    log_ignored("/v1/completions", &body, &known);
    let ext = extensions(parse_fields(&body)?, state.limits.vocab_size)?;
    let structured = structured::wire::requested(parse_fields(&body)?)?;
    structured::wire::refuse_with_allowed_tokens(structured.as_ref(), ext.allowed_token_ids.is_some())?;
    state.check_model(common.model.as_deref())?;
    let logprobs = validate::completion_logprobs(wire.logprobs, &state.limits)?;
    let echo = wire.echo.unwrap_or(false);
    // OpenAI's scoring form: `echo` with `max_tokens: 0` returns the prompt alone. The engine
    // always draws a first token, so one is generated and dropped (as vLLM does).
    let echo_only = echo && common.max_tokens == Some(0);
    let max_tokens = ("max_tokens", if echo_only { Some(1) } else { common.max_tokens });
    let mut params = validate::validate_params(common, max_tokens, logprobs, &state.defaults, &state.limits)?;
    state.force_usage(&mut params);
    let explicit_prompt_logprobs = params.prompt_logprobs;
    // `echo` with `logprobs` puts the prompt's logprobs in the same object (streamed too).
    let echo_logprobs = params.logprobs.filter(|_| echo);
    if let Some(k) = echo_logprobs {
        params.prompt_logprobs = Some(params.prompt_logprobs.map_or(k, |p| p.max(k)));
    }
    let inputs = prompt_inputs(wire.prompt, state.limits.vocab_size)?;
    let add_special_tokens = wire.add_special_tokens.unwrap_or(true);
    state.check_batch_shape(inputs.len(), params.n)?;

    let text = state.text.clone();
    let max_model_len = state.limits.max_model_len;
    let single = inputs.len() == 1;
    let stops = params.stop.clone();
    let (truncation, max_tokens) = (ext.truncation, params.max_tokens);
    // A prompt to be truncated may be longer than the context: it is cut after tokenizing.
    let tokenize_limit = if truncation.is_some() { usize::MAX } else { max_model_len };
    // One compilation serves every prompt and every completion of the request.
    let grammar = match &structured {
        Some(r) => Some(structured::compile_requested(state.grammars.as_ref(), r).await?),
        None => None,
    };
    let (prompts, stop) = blocking(move || {
        let prompts = inputs
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let (ids, echo_text) = match p {
                    PromptInput::Text(s) => {
                        (text.encode_prompt(&s, tokenize_limit, &prompt_field(single, i), add_special_tokens)?, s)
                    }
                    PromptInput::Tokens(ids) => {
                        let echo_text = if echo { echo_of_ids(&text, &ids)? } else { String::new() };
                        (ids, echo_text)
                    }
                };
                match &truncation {
                    Some(t) => Ok((t.apply(ids, max_model_len, max_tokens)?, echo_text)),
                    None => Ok((ids, echo_text)),
                }
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        Ok((prompts, stop_matcher(stops)?))
    })
    .await?;
    let lens: Vec<usize> = prompts.iter().map(|(tokens, _)| tokens.len()).collect();
    prompt_logprobs::check_response_size(&lens, params.n, explicit_prompt_logprobs, echo_logprobs)?;
    let mut requests = Vec::with_capacity(prompts.len());
    let mut echoes = Vec::new();
    for (i, (tokens, prompt_text)) in prompts.into_iter().enumerate() {
        let field = prompt_field(single, i);
        // Choices are numbered prompt-major: prompt i owns choices i*n .. (i+1)*n.
        let keep_ids = echo_logprobs.is_some() || ext.return_token_ids;
        let echo = Echo {
            text: if echo { prompt_text } else { String::new() },
            prompt: Arc::new(if keep_ids { tokens.clone() } else { vec![] }),
        };
        echoes.extend(std::iter::repeat_n(echo, params.n));
        let mut request =
            state.limits.engine_request(&params, tokens, MaxTokensDefault::Fixed(DEFAULT_MAX_TOKENS), &field)?;
        if let Some(g) = &grammar {
            structured::constrain(&mut request, g);
        }
        if let Some(ids) = &ext.allowed_token_ids {
            request.constraint = Some(crate::allowed_tokens::factory(ids, state.limits.vocab_size));
        }
        requests.push(request);
    }
    let num_prompts = requests.len();
    let mut generation = state.start_generation(requests, &params, stop)?;

    let meta = Meta::new("cmpl", state.model_name.clone());
    access.describe(&meta.id, params.stream);
    generation.report_to(access);
    let mut shape = Shape {
        logprobs: params.logprobs,
        echo_logprobs,
        echo_only,
        prompt_logprobs: explicit_prompt_logprobs,
        tokens_as_ids: params.tokens_as_ids,
        return_token_ids: ext.return_token_ids,
        text: state.text.clone(),
        prompts: PromptReports::new(num_prompts, params.n),
    };
    if params.stream {
        let usage = UsageReporting { final_chunk: params.include_usage, continuous: params.continuous_usage };
        let offsets = echoes.iter().map(|e| if echo_logprobs.is_some() { 0 } else { e.text.chars().count() }).collect();
        let pending_echo = vec![true; echoes.len()];
        let pending_prompt_ids = vec![ext.return_token_ids; echoes.len()];
        let format = CompletionStream {
            meta,
            include_usage: params.include_usage,
            echoes,
            pending_echo,
            pending_prompt_ids,
            offsets,
            shape,
        };
        return Ok(output::stream(generation, format, usage));
    }
    let (choices, usage) = output::collect(generation).await?;
    let choices =
        choices.into_iter().zip(echoes).enumerate().map(|(index, (c, echo))| shape.choice(index, c, echo)).collect();
    let usage = shape.usage(usage);
    let body =
        Completion { id: meta.id, object: "text_completion", created: meta.created, model: meta.model, choices, usage };
    Ok(Json(body).into_response())
}

/// What a choice starts with under `echo`: the prompt's text (empty without `echo`), and its
/// ids when `echo` with `logprobs` or `return_token_ids` needs them.
#[derive(Clone)]
struct Echo {
    text: String,
    prompt: Arc<Vec<u32>>,
}

/// How this request's choices are reported.
struct Shape {
    /// Alternatives per token in `logprobs`, when asked for.
    logprobs: Option<usize>,
    /// `echo` with `logprobs`: the prompt's tokens lead the `logprobs` object.
    echo_logprobs: Option<usize>,
    /// `echo` with `max_tokens: 0`: the prompt alone, the generated token dropped.
    echo_only: bool,
    /// vLLM's `prompt_logprobs` field, as asked.
    prompt_logprobs: Option<usize>,
    tokens_as_ids: bool,
    /// vLLM's `return_token_ids`: `prompt_token_ids` and `token_ids` in each choice.
    return_token_ids: bool,
    text: Arc<TextPipeline>,
    /// Each prompt's logprobs as reported, formatted once for all its choices.
    prompts: PromptReports,
}

impl Shape {
    fn choice(&mut self, index: usize, c: CollectedChoice, echo: Echo) -> CompletionChoice {
        let report = self.prompt_report(index, &echo, c.prompt_logprobs.as_ref());
        let prompt_entries = PromptReport::legacy_of(report.as_deref());
        let generated: &[TokenLogprob] = if self.echo_only { &[] } else { &c.logprobs };
        let offset = if prompt_entries.is_empty() { echo.text.chars().count() } else { 0 };
        let logprobs = self.logprobs.map(|_| legacy_logprobs(prompt_entries, generated, &mut offset.clone()));
        let (text, finish, stop_reason, matched_stop, token_ids) = if self.echo_only {
            (echo.text, Some("length"), None, None, vec![])
        } else {
            (echo.text + &c.text, c.finish.map(|f| f.as_str()), c.stop_reason, c.matched_stop, c.token_ids)
        };
        CompletionChoice {
            index,
            text,
            logprobs,
            finish_reason: finish,
            stop_reason,
            matched_stop,
            // Once per prompt, on its first choice: the others would repeat it n - 1 times.
            prompt_logprobs: report.filter(|_| index.is_multiple_of(self.prompts.n)).and_then(|r| r.vllm.clone()),
            prompt_token_ids: self.return_token_ids.then(|| echo.prompt.clone()),
            token_ids: self.return_token_ids.then_some(token_ids),
        }
    }

    /// The prompt logprobs that choice `index` reports, from the engine's `entries` for its prompt
    /// (`None` when it sent none). They depend only on the prompt, so the first of its choices
    /// formats them and the others share that, rather than each decoding every prompt token.
    fn prompt_report(
        &mut self,
        index: usize,
        echo: &Echo,
        entries: Option<&Arc<Vec<PromptTokenLogprob>>>,
    ) -> Option<Arc<PromptReport>> {
        let entries = entries?;
        // Field by field: `self.prompts` is borrowed mutably while these are read.
        let (text, tokens_as_ids) = (&self.text, self.tokens_as_ids);
        let (vllm_k, legacy_k) = (self.prompt_logprobs, self.echo_logprobs);
        Some(self.prompts.get_or_format(index, || PromptReport {
            vllm: vllm_k.map(|k| Arc::new(prompt_logprobs::vllm_list(text, entries, k))),
            legacy: legacy_k.map_or_else(Vec::new, |k| {
                prompt_logprobs::legacy_entries(text, &echo.prompt, entries, k, tokens_as_ids)
            }),
        }))
    }

    /// `echo` alone completes nothing: the token drawn and dropped is not counted.
    fn usage(&self, usage: Usage) -> Usage {
        if self.echo_only {
            Usage::new(usage.prompt_tokens, 0, usage.prompt_tokens_details.cached_tokens)
        } else {
            usage
        }
    }
}

/// One prompt's logprobs in the shapes its choices report them.
struct PromptReport {
    /// vLLM's `prompt_logprobs` field, when asked for.
    vllm: Option<Arc<PromptLogprobsWire>>,
    /// The prompt's half of the legacy `logprobs` object (empty unless `echo` with `logprobs`).
    legacy: Vec<LegacyEntry>,
}

impl PromptReport {
    /// The legacy half of `report`, empty without one.
    fn legacy_of(report: Option<&PromptReport>) -> &[LegacyEntry] {
        report.map_or(&[], |r| &r.legacy)
    }
}

/// Each prompt's `PromptReport`, made once and then shared by its `n` choices, which are
/// numbered prompt-major (prompt `i` owns choices `i*n .. (i+1)*n`).
struct PromptReports {
    n: usize,
    reports: Vec<Option<Arc<PromptReport>>>,
}

impl PromptReports {
    fn new(prompts: usize, n: usize) -> Self {
        PromptReports { n, reports: vec![None; prompts] }
    }

    /// Choice `index`'s prompt's report, made with `format` if it is the first to ask.
    fn get_or_format(&mut self, index: usize, format: impl FnOnce() -> PromptReport) -> Arc<PromptReport> {
        self.reports[index / self.n].get_or_insert_with(|| Arc::new(format())).clone()
    }
}

/// The echo of a token-id prompt: what the echo of the text it encodes would show, so without
/// the BOS the tokenizer puts in front of text itself (as SGLang echoes ids from
/// `tokenizer.encode`; vLLM shows that BOS as text). Every other special token stays.
fn echo_of_ids(text: &TextPipeline, ids: &[u32]) -> Result<String, ApiError> {
    let bos = text.tokenizer().bos().map(|b| b.id);
    let shown = match ids.split_first() {
        Some((&first, rest)) if Some(first) == bos => rest,
        _ => ids,
    };
    text.decode(shown, false)
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

/// The legacy parallel-list form: the prompt's entries (with `echo`), then the generated
/// tokens, whose alternatives include the token itself as OpenAI's do, in vLLM's order: the
/// token itself first, then by rank. `offset` is advanced past the tokens (character offsets
/// into the choice's text, as OpenAI counts them).
fn legacy_logprobs(prompt: &[LegacyEntry], generated: &[TokenLogprob], offset: &mut usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let mut push = |token: &str, logprob: Option<f32>, top: Option<TopLogprobsWire>| {
        out.tokens.push(token.to_string());
        out.token_logprobs.push(logprob);
        out.top_logprobs.push(top);
        out.text_offset.push(*offset);
        *offset += token.chars().count();
    };
    for e in prompt {
        let top = e.top.as_ref().map(|t| {
            let mut top = TopLogprobsWire::default();
            t.iter().for_each(|(s, lp)| top.push(s.clone(), *lp));
            top
        });
        push(&e.token, e.logprob, top);
    }
    for t in generated {
        let mut top = TopLogprobsWire::default();
        top.push(t.token.clone(), t.logprob);
        t.top.iter().for_each(|(s, _, lp)| top.push(s.clone(), *lp));
        push(&t.token, Some(t.logprob), Some(top));
    }
    out
}

struct CompletionStream {
    meta: Meta,
    include_usage: bool,
    /// What each choice starts with (empty text without `echo`); sent first.
    echoes: Vec<Echo>,
    /// Whether each choice's echo is still to be sent: at the opening, or with its first update
    /// when the prompt's logprobs go with it.
    pending_echo: Vec<bool>,
    /// With `return_token_ids`: whether each choice's prompt ids are still to be sent, with its
    /// first token's chunk (as vLLM sends them, beside that token's logprobs).
    pending_prompt_ids: Vec<bool>,
    /// Character offset of the next token in each choice's text.
    offsets: Vec<usize>,
    shape: Shape,
}

impl CompletionStream {
    fn chunk(&self, choices: Vec<CompletionChunkChoice>, usage: UsageField) -> Bytes {
        self.meta.chunk("text_completion", choices, usage, self.include_usage, None)
    }

    fn usage_so_far(&self, usage: Option<Usage>) -> UsageField {
        usage.map_or(UsageField::Absent, |u| UsageField::Counts(self.shape.usage(u)))
    }
}

impl StreamFormat for CompletionStream {
    fn opening(&mut self, _num_choices: usize, usage: Option<Usage>) -> Vec<Bytes> {
        if self.shape.echo_logprobs.is_some() {
            // The echo waits for the prompt's logprobs, which come with the first update.
            return vec![];
        }
        let mut chunks = vec![];
        for index in 0..self.echoes.len() {
            self.pending_echo[index] = false;
            let text = std::mem::take(&mut self.echoes[index].text);
            if !text.is_empty() {
                let c = CompletionChunkChoice {
                    index,
                    text,
                    logprobs: None,
                    finish_reason: None,
                    stop_reason: None,
                    matched_stop: None,
                    prompt_token_ids: None,
                    token_ids: None,
                };
                chunks.push(self.chunk(vec![c], self.usage_so_far(usage)));
            }
        }
        chunks
    }

    fn update(&mut self, mut u: ChoiceUpdate, usage: Option<Usage>) -> Option<Bytes> {
        if self.shape.echo_only {
            // Only the echo and the end go out; the drawn token is not part of the answer.
            u.text.clear();
            u.logprobs.clear();
            u.token_ids.clear();
            u.stop_reason = None;
            u.stop_token = None;
            u.finish = u.finish.map(|_| FinishReason::Length);
        }
        let mut text = String::new();
        let mut report = None;
        if std::mem::take(&mut self.pending_echo[u.index]) {
            text = std::mem::take(&mut self.echoes[u.index].text);
            report = self.shape.prompt_report(u.index, &self.echoes[u.index], u.prompt_logprobs.as_ref());
        }
        let prompt_token_ids =
            std::mem::take(&mut self.pending_prompt_ids[u.index]).then(|| self.echoes[u.index].prompt.clone());
        let prompt_entries = PromptReport::legacy_of(report.as_deref());
        text.push_str(&u.text);
        let token_ids = (self.shape.return_token_ids && !u.token_ids.is_empty()).then(|| u.token_ids.clone());
        if text.is_empty()
            && u.logprobs.is_empty()
            && prompt_entries.is_empty()
            && u.finish.is_none()
            && token_ids.is_none()
            && prompt_token_ids.is_none()
        {
            return None;
        }
        let has_logprobs = !u.logprobs.is_empty() || !prompt_entries.is_empty();
        let logprobs = (self.shape.logprobs.is_some() && has_logprobs)
            .then(|| legacy_logprobs(prompt_entries, &u.logprobs, &mut self.offsets[u.index]));
        let matched_stop = u.matched_stop();
        let c = CompletionChunkChoice {
            index: u.index,
            text,
            logprobs,
            finish_reason: u.finish.map(|f| f.as_str()),
            stop_reason: u.stop_reason,
            matched_stop,
            prompt_token_ids,
            token_ids,
        };
        Some(self.chunk(vec![c], self.usage_so_far(usage)))
    }

    fn usage(&mut self, usage: Usage) -> Bytes {
        self.chunk(vec![], UsageField::Counts(self.shape.usage(usage)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_prompt_is_formatted_once_for_all_its_choices() {
        // Two prompts, n = 3: choices 0..3 are prompt 0's, 3..6 prompt 1's; asked out of order,
        // as a stream's first updates come.
        let mut reports = PromptReports::new(2, 3);
        let mut formatted = vec![];
        let mut got = vec![None; 6];
        for index in [4, 0, 2, 5, 1, 3] {
            got[index] = Some(reports.get_or_format(index, || {
                formatted.push(index);
                PromptReport { vllm: None, legacy: vec![] }
            }));
        }
        assert_eq!(formatted, vec![4, 0], "the first choice of each prompt to ask formats it");
        let got: Vec<Arc<PromptReport>> = got.into_iter().map(Option::unwrap).collect();
        for index in 0..6 {
            assert!(Arc::ptr_eq(&got[index], &got[index / 3 * 3]), "choice {index} shares its prompt's");
        }
        assert!(!Arc::ptr_eq(&got[0], &got[3]));
    }
}
