//! `POST /tokenize`, `POST /detokenize` (vLLM's shapes) and `GET /version`. They sit behind the
//! API key like `/v1` (vLLM leaves them open; here they cost tokenizer time, so they are not).
//! `/tokenize` refuses what the generation endpoints refuse: a prompt longer than the context
//! (vLLM counts any length, at a cost in memory proportional to the text).

use crate::error::ApiError;
use crate::extract::JsonObject;
use crate::protocol::chat::ChatWire;
use crate::protocol::parse_fields;
use crate::protocol::tokenize::*;
use crate::state::{blocking, AppState};
use crate::validate::chat_options::chat_prompt_options;
use crate::validate::tools::tool_request;
use crate::validate::{messages::template_messages, token_id};
use axum::extract::State;
use axum::Json;
use serde::de::IgnoredAny;
use serde_json::{json, Value};
use std::sync::Arc;

/// Request fields of vLLM's tokenize request that change its result and are not implemented
/// here: refused by name rather than ignored.
const UNSUPPORTED: [&str; 2] = ["chat_template", "mm_processor_kwargs"];

pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let wire: TokenizeWire = parse_fields(&body)?;
    state.check_model(wire.model.as_deref())?;
    if let Some(field) = UNSUPPORTED.iter().find(|f| body.get(**f).is_some_and(|v| !v.is_null())) {
        return Err(ApiError::invalid(*field, format!("`{field}` is not supported by /tokenize")));
    }
    let text = state.text.clone();
    let return_strs = wire.return_token_strs.unwrap_or(false);
    // The generation endpoints' limit and way of counting: a text clearly longer than the
    // context is refused after counting a bounded prefix of it, and tokenizing costs what a
    // prompt that fits costs (a 1 MiB body cost 170 MB tokenized whole; 32 at once, 5.4 GB).
    let max_model_len = state.limits.max_model_len;
    let field = if wire.prompt.is_some() { "prompt" } else { "messages" };
    let tokens = match (wire.prompt, wire.messages) {
        (Some(prompt), None) => {
            if wire.add_generation_prompt.is_some() {
                return Err(ApiError::invalid(
                    "add_generation_prompt",
                    "`add_generation_prompt` applies to `messages` only",
                ));
            }
            let special = wire.add_special_tokens.unwrap_or(true);
            blocking(move || text.encode_prompt(&prompt, max_model_len, "prompt", special)).await?
        }
        (None, Some(messages)) => {
            if wire.add_special_tokens == Some(true) {
                return Err(ApiError::invalid(
                    "add_special_tokens",
                    "`add_special_tokens: true` with `messages` is not supported: the chat template writes the special tokens",
                ));
            }
            let messages = template_messages(&messages)?;
            // The chat endpoint's prompt options and tools, so the count is the prompt chat
            // would send; its other fields are read as chat reads them, but not the messages
            // again.
            let chat = parse_fields::<ChatWire<IgnoredAny>>(&body)?;
            let mut options = chat_prompt_options(&chat, &messages)?;
            options.tools = tool_request(chat.tools.as_ref(), None, None, chat.functions.as_ref())?.tools;
            blocking(move || text.chat_prompt(&messages, max_model_len, &options)).await?
        }
        _ => return Err(ApiError::invalid("prompt", "send exactly one of `prompt` and `messages`")),
    };
    if tokens.len() > max_model_len {
        return Err(ApiError::PromptTooLong { field: field.into(), limit: max_model_len, counted: max_model_len });
    }
    let token_strs = return_strs.then(|| {
        let tokenizer = state.text.tokenizer();
        tokens.iter().map(|&t| tokenizer.id_to_token(t).unwrap_or_default()).collect()
    });
    Ok(Json(TokenizeResponse { count: tokens.len(), max_model_len: state.limits.max_model_len, tokens, token_strs }))
}

pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let wire: DetokenizeWire = parse_fields(&body)?;
    state.check_model(wire.model.as_deref())?;
    let vocab = state.limits.vocab_size;
    let ids = wire
        .tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| token_id(&format!("tokens[{i}]"), t, vocab))
        .collect::<Result<Vec<u32>, ApiError>>()?;
    let text = state.text.clone();
    let prompt = blocking(move || text.decode(&ids, false)).await?;
    Ok(Json(DetokenizeResponse { prompt }))
}

/// `{"version": ...}`, vLLM's shape, with mla-serve's own version.
pub async fn version() -> Json<Value> {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") }))
}
