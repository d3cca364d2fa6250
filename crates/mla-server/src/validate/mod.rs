//! Wire fields -> validated parameters (the split TGI's router makes): every range check lives
//! here and every error names the offending field. What needs the prompt length (the context
//! check, the default `max_tokens`) happens later in `limits`, after tokenization.

mod limits;
#[cfg(test)]
mod tests;

pub mod chat_options;
pub mod extensions;
pub mod messages;
pub mod prompt;
pub mod tools;

pub use limits::{MaxTokensDefault, ModelLimits};

use crate::error::ApiError;
use crate::generation_config::GenerationDefaults;
use crate::protocol::common::{SamplingWire, UnsupportedWire};
use crate::protocol::completions::ToolFieldsWire;
use mla_core::SamplingParams;

/// OpenAI caps `n` at 128; more would only be a way to exhaust the cache with one request.
pub const MAX_N: i64 = 128;
/// Stop strings per request and bytes per stop string. Each generated token is checked against
/// every stop string, so unbounded lists let one request tax every token of its stream (OpenAI
/// allows 4 strings; these leave room for clients that send more).
pub const MAX_STOP_STRINGS: usize = 64;
pub const MAX_STOP_STRING_BYTES: usize = 1024;
/// Most logprob alternatives per token unless `--max-logprobs` says otherwise (vLLM's default).
pub const MAX_LOGPROBS: usize = 20;

/// A request's parameters after validation, independent of the endpoint's wire shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedParams {
    pub sampling: SamplingParams,
    pub seed: Option<u64>,
    /// As sent; `None` falls back to the endpoint's default in `ModelLimits::engine_request`.
    pub max_tokens: Option<usize>,
    pub n: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    /// `Some(k)`: report each token's logprob with `k` alternatives.
    pub logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    /// Logprob tokens are named `token_id:<id>` (vLLM's `return_tokens_as_token_ids`).
    pub tokens_as_ids: bool,
    /// Sorted by token, each token once.
    pub logit_bias: Vec<(u32, f32)>,
    pub min_tokens: usize,
    /// The matched stop string (or stop token's text) stays in the output.
    pub include_stop_str: bool,
    /// With `include_usage`, every chunk carries the usage so far.
    pub continuous_usage: bool,
    /// `Some(k)`: the engine scores every prompt token with `k` alternatives (vLLM's
    /// `prompt_logprobs`; completions' `echo` with `logprobs` asks for them too).
    pub prompt_logprobs: Option<usize>,
}

/// Validates the shared fields. `max_tokens` is the endpoint's effective field (chat prefers
/// `max_completion_tokens`), passed with its name for error messages.
pub fn validate_params(
    w: SamplingWire,
    max_tokens: (&str, Option<i64>),
    logprobs: Option<usize>,
    defaults: &GenerationDefaults,
    limits: &ModelLimits,
) -> Result<ValidatedParams, ApiError> {
    let vocab_size = limits.vocab_size;
    let temperature = w.temperature.or(defaults.temperature).unwrap_or(1.0);
    check_range("temperature", temperature, 0.0, 2.0)?;
    let top_p = w.top_p.or(defaults.top_p).unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p", format!("top_p must be in (0, 1], got {top_p}")));
    }
    let top_k = match w.top_k.or(defaults.top_k).unwrap_or(0) {
        // -1 is vLLM's spelling of "disabled", 0 OpenAI-style clients'.
        -1 | 0 => None,
        k if k > 0 => Some(k as usize),
        k => return Err(ApiError::invalid("top_k", format!("top_k must be -1 (disabled) or at least 1, got {k}"))),
    };
    let min_p = w.min_p.or(defaults.min_p).unwrap_or(0.0);
    check_range("min_p", min_p, 0.0, 1.0)?;
    let presence_penalty = w.presence_penalty.unwrap_or(0.0);
    check_range("presence_penalty", presence_penalty, -2.0, 2.0)?;
    let frequency_penalty = w.frequency_penalty.unwrap_or(0.0);
    check_range("frequency_penalty", frequency_penalty, -2.0, 2.0)?;
    let repetition_penalty = w.repetition_penalty.or(defaults.repetition_penalty).unwrap_or(1.0);
    if !(repetition_penalty.is_finite() && repetition_penalty > 0.0) {
        return Err(ApiError::invalid(
            "repetition_penalty",
            format!("repetition_penalty must be greater than 0, got {repetition_penalty}"),
        ));
    }

    let (max_name, max_value) = max_tokens;
    let max_tokens = match max_value {
        None => None,
        Some(m) if m >= 1 => Some(m as usize),
        Some(m) => return Err(ApiError::invalid(max_name, format!("{max_name} must be at least 1, got {m}"))),
    };
    let n = w.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::invalid("n", format!("n must be between 1 and {MAX_N}, got {n}")));
    }
    let stop = w.stop.map(|s| s.into_vec()).unwrap_or_default();
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOP_STRINGS} stop strings are allowed, got {}", stop.len()),
        ));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return Err(ApiError::invalid(
            "stop",
            format!("a stop string may be at most {MAX_STOP_STRING_BYTES} bytes, got one of {}", long.len()),
        ));
    }
    let stop_token_ids = w
        .stop_token_ids
        .unwrap_or_default()
        .into_iter()
        .map(|t| token_id("stop_token_ids", t, vocab_size))
        .collect::<Result<Vec<_>, _>>()?;
    let logit_bias = logit_bias(w.logit_bias.unwrap_or_default(), vocab_size)?;
    let min_tokens = match w.min_tokens.unwrap_or(0) {
        m if m < 0 => return Err(ApiError::invalid("min_tokens", format!("min_tokens must be at least 0, got {m}"))),
        m if max_tokens.is_some_and(|x| m as usize > x) => {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("min_tokens ({m}) must be at most {max_name} ({})", max_tokens.unwrap_or(0)),
            ))
        }
        m => m as usize,
    };
    let stream = w.stream.unwrap_or(false);
    if w.stream_options.is_some() && !stream {
        return Err(ApiError::invalid("stream_options", "stream_options is only allowed when stream is true"));
    }

    let prompt_logprobs = w.prompt_logprobs.map(|k| logprob_count("prompt_logprobs", k, limits)).transpose()?;
    // vLLM's rule: a stream has no place for them (0 asks for none, so it passes).
    if stream && prompt_logprobs.is_some_and(|k| k > 0) {
        return Err(ApiError::invalid("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`"));
    }
    let include_usage = w.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
    let continuous_usage = w.stream_options.as_ref().and_then(|o| o.continuous_usage_stats).unwrap_or(false);

    Ok(ValidatedParams {
        sampling: SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            min_p: min_p as f32,
            presence_penalty: presence_penalty as f32,
            frequency_penalty: frequency_penalty as f32,
            repetition_penalty: repetition_penalty as f32,
        },
        // OpenAI seeds are signed 64-bit; reinterpreting keeps every value distinct.
        seed: w.seed.map(|s| s as u64),
        max_tokens,
        n: n as usize,
        stop,
        stop_token_ids,
        ignore_eos: w.ignore_eos.unwrap_or(false),
        skip_special_tokens: w.skip_special_tokens.unwrap_or(true),
        logprobs,
        stream,
        include_usage,
        tokens_as_ids: w.return_tokens_as_token_ids.unwrap_or(false),
        logit_bias,
        min_tokens,
        include_stop_str: w.include_stop_str_in_output.unwrap_or(false),
        // As vLLM: per-chunk usage only where the final usage is asked for.
        continuous_usage: include_usage && continuous_usage,
        prompt_logprobs: prompt_logprobs.filter(|_| !stream),
    })
}

/// OpenAI's bias range: -100 bans a token in effect, +100 all but forces it.
pub const MAX_LOGIT_BIAS: f64 = 100.0;

/// `logit_bias` (token id strings -> bias) as sorted (token, bias) pairs.
fn logit_bias(map: std::collections::BTreeMap<String, f64>, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    // Every key that is not a token id is named at once, so a client fixes them in one go (vLLM's
    // message lists them all).
    let (ids, bad): (Vec<_>, Vec<_>) =
        map.iter().map(|(k, b)| (k, k.trim().parse::<i64>(), *b)).partition(|e| e.1.is_ok());
    if !bad.is_empty() {
        let keys: Vec<String> = bad.iter().map(|(k, _, _)| format!("{k:?}")).collect();
        return Err(ApiError::invalid(
            "logit_bias",
            format!("logit_bias keys must be token ids, got {}", keys.join(", ")),
        ));
    }
    let mut bias = Vec::with_capacity(map.len());
    for (_, t, b) in ids {
        let Ok(t) = t else { continue }; // partitioned above: every id here parsed
        let t = token_id("logit_bias", t, vocab_size)?;
        if !(b.is_finite() && (-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&b)) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("the bias of token {t} must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {b}"),
            ));
        }
        bias.push((t, b as f32));
    }
    bias.sort_by_key(|&(t, _)| t);
    // "01" and "1" name one token; which bias was meant is not clear, so neither is guessed.
    if let Some(w) = bias.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ApiError::invalid("logit_bias", format!("token {} appears twice in logit_bias", w[0].0)));
    }
    Ok(bias)
}

/// Chat's `logprobs: bool` + `top_logprobs: int` -> alternatives per token.
pub fn chat_logprobs(
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    limits: &ModelLimits,
) -> Result<Option<usize>, ApiError> {
    match (logprobs.unwrap_or(false), top_logprobs) {
        (false, Some(_)) => Err(ApiError::invalid("top_logprobs", "top_logprobs requires logprobs to be true")),
        (false, None) => Ok(None),
        (true, k) => logprob_count("top_logprobs", k.unwrap_or(0), limits).map(Some),
    }
}

/// Completions' `logprobs: int` -> alternatives per token.
pub fn completion_logprobs(logprobs: Option<i64>, limits: &ModelLimits) -> Result<Option<usize>, ApiError> {
    logprobs.map(|k| logprob_count("logprobs", k, limits)).transpose()
}

/// At most `--max-logprobs` alternatives; -1 asks for the whole vocabulary, as in vLLM.
fn logprob_count(field: &str, k: i64, limits: &ModelLimits) -> Result<usize, ApiError> {
    let max = limits.max_logprobs;
    let count = match k {
        -1 => limits.vocab_size,
        k if k >= 0 => usize::try_from(k).unwrap_or(usize::MAX),
        _ => usize::MAX,
    };
    if count <= max {
        Ok(count)
    } else {
        Err(ApiError::invalid(
            field,
            format!(
                "{field} must be between 0 and {max} (the server's --max-logprobs), or -1 for the whole vocabulary \
                 when --max-logprobs allows it; got {k}"
            ),
        ))
    }
}

/// A token id sent by the client, checked against the vocabulary.
pub fn token_id(field: &str, t: i64, vocab_size: usize) -> Result<u32, ApiError> {
    if t >= 0 && (t as u64) < vocab_size as u64 {
        Ok(t as u32)
    } else {
        Err(ApiError::invalid(field, format!("token id {t} in {field} is outside the vocabulary (0..{vocab_size})")))
    }
}

fn check_range(field: &str, v: f64, lo: f64, hi: f64) -> Result<(), ApiError> {
    if v.is_finite() && v >= lo && v <= hi {
        Ok(())
    } else {
        Err(ApiError::invalid(field, format!("{field} must be in [{lo}, {hi}], got {v}")))
    }
}

/// Refuses OpenAI features that would change the output but are not implemented.
pub fn refuse_unsupported(u: &UnsupportedWire) -> Result<(), ApiError> {
    if u.best_of.is_some_and(|b| b != 1) {
        return Err(unsupported("best_of"));
    }
    if u.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("suffix"));
    }
    Ok(())
}

/// Refuses tools on a completion: its raw prompt has no chat template to render them into, and
/// its output is not parsed for calls. An empty list and `tool_choice: "none"` ask for nothing.
pub fn refuse_tools(t: &ToolFieldsWire) -> Result<(), ApiError> {
    if t.tools.as_ref().is_some_and(|t| !t.is_empty()) || t.functions.as_ref().is_some_and(|f| !f.is_empty()) {
        return Err(unsupported("tools"));
    }
    if t.tool_choice.as_ref().is_some_and(|c| c.as_str() != Some("none")) {
        return Err(unsupported("tool_choice"));
    }
    Ok(())
}

/// One message for every feature refused by name.
fn unsupported(field: &str) -> ApiError {
    ApiError::invalid(field, format!("{field} is not supported by this server"))
}
