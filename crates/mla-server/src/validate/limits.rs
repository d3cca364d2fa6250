//! The checks that need the tokenized prompt: context length and the default `max_tokens`.

use super::ValidatedParams;
use crate::error::ApiError;
use mla_engine::GenerateRequest;

/// What the served model allows; fixed at startup.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelLimits {
    pub max_model_len: usize,
    pub vocab_size: usize,
    /// Ids that end a completion unless `ignore_eos` (config, generation config and tokenizer).
    pub eos_token_ids: Vec<u32>,
    /// `generation_config.json`'s `max_new_tokens`, which replaces the endpoint default.
    pub default_max_new_tokens: Option<usize>,
    /// Most logprob alternatives a request may ask for (`--max-logprobs`, vLLM's default 20).
    pub max_logprobs: usize,
}

/// What an unset `max_tokens` means for an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxTokensDefault {
    /// Chat: generate until the context is full (or a stop).
    RestOfContext,
    /// Completions: OpenAI's 16, cut to what still fits.
    Fixed(usize),
}

impl ModelLimits {
    /// Builds the engine request for one prompt, or explains why it cannot fit.
    /// `prompt_field` names the field the prompt came from, for the error's `param`.
    pub fn engine_request(
        &self,
        params: &ValidatedParams,
        prompt_tokens: Vec<u32>,
        default: MaxTokensDefault,
        prompt_field: &str,
    ) -> Result<GenerateRequest, ApiError> {
        let prompt = prompt_tokens.len();
        if prompt == 0 {
            return Err(ApiError::invalid(
                prompt_field,
                format!("{prompt_field} is empty: it must have at least one token"),
            ));
        }
        let room = self.max_model_len.saturating_sub(prompt);
        let max_tokens = match (params.max_tokens, self.default_max_new_tokens, default) {
            // An explicit value is honoured or refused, never silently cut.
            (Some(m), _, _) => m,
            (None, Some(g), _) => g.min(room),
            (None, None, MaxTokensDefault::RestOfContext) => room,
            (None, None, MaxTokensDefault::Fixed(f)) => f.min(room),
        };
        let needed = prompt + max_tokens.max(1);
        if room == 0 || needed > self.max_model_len {
            return Err(ApiError::ContextTooLong {
                field: Some(prompt_field.to_string()),
                limit: self.max_model_len,
                needed,
                prompt,
                completion: max_tokens.max(1),
            });
        }
        let mut stop_token_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_token_ids.extend(self.eos_token_ids.iter().filter(|t| !params.stop_token_ids.contains(t)));
        }
        Ok(GenerateRequest {
            prompt_tokens,
            n: params.n,
            sampling: params.sampling.clone(),
            seed: params.seed,
            max_tokens,
            stop_token_ids,
            logprobs: params.logprobs,
            prompt_logprobs: params.prompt_logprobs,
            owner: None,
            logit_bias: params.logit_bias.clone(),
            min_tokens: params.min_tokens,
            constraint: None,
        })
    }
}
