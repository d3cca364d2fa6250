//! `/v1/completions`: request fields, the response and its stream chunks.

use super::common::{PromptLogprobsWire, StopReason, Usage, UsageField};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Completions-only request fields (the shared ones are in `SamplingWire`).
#[derive(Debug, Deserialize)]
pub struct CompletionWire {
    pub prompt: PromptWire,
    /// Number of alternatives to report per token (OpenAI's completions form: an integer).
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    /// vLLM's: text prompts get the tokenizer's special tokens (BOS); default true.
    pub add_special_tokens: Option<bool>,
}

/// Chat's tool fields, which a completion cannot honour: read only to refuse them
/// (`validate::refuse_tools`). Chat reads and checks its own (`ChatWire`, `validate::tools`).
#[derive(Debug, Default, Deserialize)]
pub struct ToolFieldsWire {
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Vec<Value>>,
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of such lists.
/// Token ids are signed so that a negative id is reported as an invalid value, not a type error.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptWire {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<StopReason>,
    /// vLLM's `prompt_logprobs`, when asked for: on the first choice of each prompt only (vLLM
    /// repeats them on each of the `n`, which multiplied a 20 KB request into 648 MB).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Arc<PromptLogprobsWire>>,
}

/// The legacy logprobs object: parallel lists, one entry per token (with `echo`, the prompt's
/// tokens first; the first prompt token has `null` for its logprob and alternatives).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
}
