//! `/v1/completions`: request fields, the response, and the choices of its stream chunks (the
//! chunk around them is `common::StreamChunk`).

use super::common::{PromptLogprobsWire, StopReason, TopLogprobsWire, Usage};
use serde::{Deserialize, Serialize};
use serde_json::Value;
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

/// A choice of a whole response. vLLM sends its keys whether asked for or not (`null` then), and
/// clients read them without asking; SGLang's `matched_stop` likewise.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<StopReason>,
    /// SGLang's: the stop string or stop token (EOS included) that ended the choice.
    pub matched_stop: Option<StopReason>,
    /// vLLM's `prompt_logprobs`, when asked for: on the first choice of each prompt only (vLLM
    /// repeats them on each of the `n`, which multiplied a 20 KB request into 648 MB); `null`
    /// on the others, as on every choice when not asked for.
    pub prompt_logprobs: Option<Arc<PromptLogprobsWire>>,
    /// vLLM's `return_token_ids`: the prompt's ids and the generated ones.
    pub prompt_token_ids: Option<Arc<Vec<u32>>>,
    pub token_ids: Option<Vec<u32>>,
}

/// A choice of a stream chunk: vLLM's keys only when they carry something (its chunks leave
/// unset keys out), SGLang's `matched_stop` always.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChunkChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<StopReason>,
    pub matched_stop: Option<StopReason>,
    /// With `return_token_ids`: on the choice's first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Arc<Vec<u32>>>,
    /// With `return_token_ids`: the ids this chunk adds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// The legacy logprobs object: parallel lists, one entry per token (with `echo`, the prompt's
/// tokens first; the first prompt token has `null` for its logprob and alternatives).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<TopLogprobsWire>>,
    pub text_offset: Vec<usize>,
}
