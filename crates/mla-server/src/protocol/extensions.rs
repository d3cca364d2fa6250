//! vLLM's and SGLang's request fields beyond OpenAI's: those both endpoints read
//! (`ExtensionsWire`), those only chat reads (`ChatExtensionsWire`), and those read only to refuse
//! them (`RefusedExtensionsWire`, see `validate::extensions`).

use serde::Deserialize;

/// Both endpoints.
#[derive(Debug, Default, Deserialize)]
pub struct ExtensionsWire {
    /// vLLM: the response carries the prompt's ids (`prompt_token_ids`) and each choice's
    /// generated ids (`token_ids`).
    pub return_token_ids: Option<bool>,
    /// vLLM: keep only this many prompt tokens; -1 keeps as many as fit beside `max_tokens`.
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM: `left` (the default) keeps the last tokens, `right` the first.
    pub truncation_side: Option<String>,
    /// vLLM: only these token ids may be drawn.
    pub allowed_token_ids: Option<Vec<i64>>,
}

/// Chat only: how the reply's thinking block is reported (`--reasoning-parser`), and vLLM's
/// chat `echo`.
#[derive(Debug, Default, Deserialize)]
pub struct ChatExtensionsWire {
    /// vLLM (default true): false leaves the reasoning out of the response, and a decoding
    /// constraint applies from the first token instead of after the thinking block.
    pub include_reasoning: Option<bool>,
    /// SGLang (default true): false does not split the reply, the thinking stays in `content`.
    pub separate_reasoning: Option<bool>,
    /// SGLang (default true): false streams the reasoning as one delta once it is complete.
    pub stream_reasoning: Option<bool>,
    /// vLLM: the reply starts with the final message's content when that message is the
    /// assistant's (the message `continue_final_message` continues).
    pub echo: Option<bool>,
}

/// Fields of the peers that change the output and have no implementation here: read only so
/// that a request using them gets a 400 naming them rather than a different answer.
#[derive(Debug, Default, Deserialize)]
pub struct RefusedExtensionsWire {
    /// vLLM: beam search.
    pub use_beam_search: Option<bool>,
    /// vLLM: the logprobs of these token ids at every position.
    pub logprob_token_ids: Option<Vec<i64>>,
}
