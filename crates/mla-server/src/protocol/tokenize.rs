//! vLLM's `/tokenize` and `/detokenize` bodies (its clients and benchmark tools call them).

use super::chat::MessageWire;
use serde::{Deserialize, Serialize};

/// Either `prompt` (a completions prompt) or `messages` (rendered by the chat template).
#[derive(Debug, Deserialize)]
pub struct TokenizeWire {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<MessageWire>>,
    /// Default: true for a prompt (BOS, as completions add it), false for messages (the template
    /// writes BOS itself), as in vLLM.
    pub add_special_tokens: Option<bool>,
    /// Messages only; default true.
    pub add_generation_prompt: Option<bool>,
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeWire {
    pub model: Option<String>,
    pub tokens: Vec<i64>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}
