//! Fields shared by `/v1/chat/completions` and `/v1/completions`, the `usage` object, and the
//! stream chunk both send.

use serde::{Deserialize, Serialize};

/// Sampling and control fields both endpoints accept. `None` means "not sent".
#[derive(Debug, Default, Deserialize)]
pub struct SamplingWire {
    pub model: Option<String>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub max_tokens: Option<i64>,
    pub n: Option<i64>,
    pub stop: Option<StopWire>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub seed: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptionsWire>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub ignore_eos: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    /// vLLM extension: logprob tokens as `token_id:<id>`.
    pub return_tokens_as_token_ids: Option<bool>,
    /// Token id (as a string, OpenAI's shape) -> bias added to its logit, in [-100, 100].
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// vLLM extension: stop tokens (and stop strings) cannot end a completion earlier.
    pub min_tokens: Option<i64>,
    /// vLLM extension: keep the matched stop string (or stop token text) in the output.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM extension: the logprob of every prompt token with this many alternatives.
    pub prompt_logprobs: Option<i64>,
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopWire {
    One(String),
    Many(Vec<String>),
}

impl StopWire {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopWire::One(s) => vec![s],
            StopWire::Many(v) => v,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptionsWire {
    pub include_usage: Option<bool>,
    /// vLLM extension: with `include_usage`, every chunk carries the usage so far.
    pub continuous_usage_stats: Option<bool>,
}

/// OpenAI fields that change what is generated but that this server does not implement.
/// They are read only to refuse them (`response_format` is read by `structured::wire`): silently ignoring them would return something other than
/// what the client asked for. (Fields that do not change the output, like `user`, are ignored.)
/// The tool fields, which only completions refuse, are `completions::ToolFieldsWire`.
#[derive(Debug, Default, Deserialize)]
pub struct UnsupportedWire {
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
}

/// vLLM's `stop_reason`: the stop string that ended a choice, or the `stop_token_ids` entry;
/// `null` when it ended with EOS or by length. The same shape is SGLang's `matched_stop`, which
/// names EOS too.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum StopReason {
    Text(String),
    Token(u32),
}

/// vLLM's prompt logprobs: `null` for the first prompt token, then per token an object keyed by
/// token id holding the prompt token itself and the most likely alternatives.
pub type PromptLogprobsWire = Vec<Option<PromptPositionWire>>;

/// One position's entries in vLLM's order: the prompt token first, then the alternatives.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptPositionWire(pub Vec<(u32, LogprobEntryWire)>);

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LogprobEntryWire {
    pub logprob: f32,
    pub rank: u32,
    pub decoded_token: String,
}

impl Serialize for PromptPositionWire {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (id, entry) in &self.0 {
            map.serialize_entry(id, entry)?;
        }
        map.end()
    }
}

/// A completions `top_logprobs` object: token text -> logprob, in vLLM's order (the chosen
/// token first, then the alternatives by rank). A text two tokens share is one key, at its first
/// place with the later value, as a Python dict built in that order keeps it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobsWire(pub Vec<(String, f32)>);

impl TopLogprobsWire {
    pub fn push(&mut self, token: String, logprob: f32) {
        match self.0.iter_mut().find(|(t, _)| *t == token) {
            Some(entry) => entry.1 = logprob,
            None => self.0.push((token, logprob)),
        }
    }
}

impl Serialize for TopLogprobsWire {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (token, logprob) in &self.0 {
            map.serialize_entry(token, logprob)?;
        }
        map.end()
    }
}

/// The token counts of a response. Beside OpenAI's fields it carries DeepSeek's platform's
/// `prompt_cache_hit_tokens` and `prompt_cache_miss_tokens` (the prompt split by the prefix
/// cache), so clients written against DeepSeek's API read their cache savings unchanged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    pub prompt_cache_hit_tokens: usize,
    pub prompt_cache_miss_tokens: usize,
}

/// OpenAI's breakdown of the prompt: `cached_tokens` came from the prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        debug_assert!(cached_tokens <= prompt_tokens, "{cached_tokens} of {prompt_tokens} prompt tokens cached");
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
            prompt_cache_hit_tokens: cached_tokens,
            prompt_cache_miss_tokens: prompt_tokens.saturating_sub(cached_tokens),
        }
    }
}

/// One chunk of a streamed chat or completion response: the envelope the two endpoints share
/// around their own choices (`ChatChunkChoice`, `CompletionChunkChoice`).
#[derive(Debug, Clone, Serialize)]
pub struct StreamChunk<C> {
    pub id: String,
    /// `chat.completion.chunk` or `text_completion`.
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    /// Present (as `null` until the last chunk) only when `stream_options.include_usage` is set,
    /// as OpenAI does.
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
    /// Chat with `return_token_ids`: on the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

/// The three states of a chunk's `usage`: absent, `null`, or the counts.
#[derive(Debug, Clone, Copy, Default)]
pub enum UsageField {
    #[default]
    Absent,
    Null,
    Counts(Usage),
}

impl UsageField {
    pub fn is_absent(&self) -> bool {
        matches!(self, UsageField::Absent)
    }

    /// The field of a stream chunk: left out unless the client asked for usage
    /// (`stream_options.include_usage`), then `null` on every chunk without counts, as OpenAI
    /// sends it.
    pub fn in_stream(self, include_usage: bool) -> UsageField {
        match (include_usage, self) {
            (false, _) => UsageField::Absent,
            (true, UsageField::Absent) => UsageField::Null,
            (true, u) => u,
        }
    }
}

impl Serialize for UsageField {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            UsageField::Counts(u) => u.serialize(s),
            _ => s.serialize_none(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DeepSeek's platform splits the prompt into cache hits and misses beside OpenAI's details.
    #[test]
    fn usage_carries_openai_and_deepseek_cache_fields() {
        let v = serde_json::to_value(Usage::new(100, 7, 64)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
                "prompt_tokens_details": {"cached_tokens": 64},
                "prompt_cache_hit_tokens": 64, "prompt_cache_miss_tokens": 36})
        );
        let none = serde_json::to_value(Usage::new(5, 0, 0)).unwrap();
        assert_eq!(
            (none["prompt_cache_hit_tokens"].as_u64(), none["prompt_cache_miss_tokens"].as_u64()),
            (Some(0), Some(5))
        );
        assert_eq!(none["prompt_tokens_details"]["cached_tokens"], 0, "present when nothing was cached");
    }
}
