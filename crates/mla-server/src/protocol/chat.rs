//! `/v1/chat/completions`: request fields, the response, and the choices of its stream chunks
//! (the chunk around them is `common::StreamChunk`).

use super::common::{PromptLogprobsWire, StopReason, Usage};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Chat-only request fields (the shared ones are in `SamplingWire`). `M` is what `messages` is
/// read as: `/tokenize` has read them already (`TokenizeWire`), so it skips them (`IgnoredAny`).
#[derive(Debug, Deserialize)]
pub struct ChatWire<M = Vec<MessageWire>> {
    pub messages: M,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Read as JSON values so that `validate::tools` can name what is wrong with them.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<Value>,
    pub functions: Option<Value>,
    /// Whether the template appends the assistant prompt (default true, as vLLM).
    pub add_generation_prompt: Option<bool>,
    /// End the prompt inside the final (assistant) message, so the model continues it.
    pub continue_final_message: Option<bool>,
    /// Extra chat template variables (vLLM's), e.g. `thinking` for DeepSeek V3.1.
    pub chat_template_kwargs: Option<Value>,
    /// Let special-token text inside message content become special tokens (off: such text is
    /// tokenized as the plain text it is, so content cannot forge turns).
    pub parse_special_tokens_in_content: Option<bool>,
    /// vLLM's: add the tokenizer's special tokens on top of the template's; only false (the
    /// default) is supported, as the templates write BOS themselves.
    pub add_special_tokens: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct MessageWire {
    pub role: String,
    pub content: Option<ContentWire>,
    pub name: Option<String>,
    /// Passed to the template as sent (the DeepSeek templates render assistant tool calls).
    pub tool_calls: Option<Value>,
    pub tool_call_id: Option<String>,
}

/// `content`: a string, or a list of parts of which only text parts are supported.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ContentWire {
    Text(String),
    Parts(Vec<ContentPartWire>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPartWire {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// vLLM's `prompt_logprobs` (chat has one prompt, so they sit here, not in a choice);
    /// `null` unless asked for, as vLLM sends it.
    pub prompt_logprobs: Option<PromptLogprobsWire>,
    /// vLLM's `return_token_ids`: the rendered prompt's ids (`null` unless asked for).
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<StopReason>,
    /// SGLang's: the stop string or stop token (EOS included) that ended the choice.
    pub matched_stop: Option<StopReason>,
    /// vLLM's `return_token_ids`: the generated ids (`null` unless asked for).
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// `null` when a parser took everything (all reasoning, or only tool calls), as OpenAI.
    pub content: Option<String>,
    /// The reply's thinking block (`--reasoning-parser`), `null` when there is none, under
    /// vLLM's name since 2026 (`reasoning`) and SGLang's and DeepSeek's (`reasoning_content`);
    /// clients read one or the other without asking, so both are always sent.
    pub reasoning: Option<String>,
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// A JSON text, as the model wrote it.
    pub arguments: String,
}

/// A piece of a streamed tool call: the first piece of a call has `id`, `type` and
/// `function.name` (with empty arguments), later ones only argument text, as OpenAI streams.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallChunk {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionChunk,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionChunk {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<StopReason>,
    pub matched_stop: Option<StopReason>,
    /// With `return_token_ids`: the ids this chunk adds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Both names in every delta, `null` when it carries none (SGLang sends the key always).
    pub reasoning: Option<String>,
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallChunk>>,
}
