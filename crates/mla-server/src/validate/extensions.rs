//! vLLM's `return_token_ids`, `truncate_prompt_tokens` with `truncation_side`, and
//! `allowed_token_ids`, checked; and the peers' fields that are refused by name.

use super::{token_id, unsupported};
use crate::error::ApiError;
use crate::protocol::extensions::{ExtensionsWire, RefusedExtensionsWire};

/// The checked extension fields of one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Extensions {
    pub return_token_ids: bool,
    pub truncation: Option<Truncation>,
    /// Sorted, each id once; never empty.
    pub allowed_token_ids: Option<Vec<u32>>,
}

/// `truncate_prompt_tokens` and `truncation_side`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncation {
    /// `None`: -1, as many as fit beside `max_tokens`.
    pub keep: Option<usize>,
    pub side: Side,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Keeps the last tokens: the end of a prompt is what the model continues (vLLM's default
    /// for generative models).
    Left,
    /// Keeps the first tokens.
    Right,
}

pub fn extensions(w: ExtensionsWire, vocab_size: usize) -> Result<Extensions, ApiError> {
    let side = match w.truncation_side.as_deref() {
        None | Some("left") => Side::Left,
        Some("right") => Side::Right,
        Some(other) => {
            return Err(ApiError::invalid(
                "truncation_side",
                format!("truncation_side must be \"left\" or \"right\", got {other:?}"),
            ))
        }
    };
    let truncation = match w.truncate_prompt_tokens {
        None => None,
        Some(-1) => Some(Truncation { keep: None, side }),
        Some(n) if n >= 1 => Some(Truncation { keep: Some(n as usize), side }),
        Some(n) => {
            return Err(ApiError::invalid(
                "truncate_prompt_tokens",
                format!("truncate_prompt_tokens must be -1 (as many as fit) or at least 1, got {n}"),
            ))
        }
    };
    let allowed_token_ids = match w.allowed_token_ids {
        None => None,
        Some(ids) if ids.is_empty() => {
            return Err(ApiError::invalid("allowed_token_ids", "allowed_token_ids must not be empty"))
        }
        Some(ids) => {
            let mut ids =
                ids.into_iter().map(|t| token_id("allowed_token_ids", t, vocab_size)).collect::<Result<Vec<_>, _>>()?;
            ids.sort_unstable();
            ids.dedup();
            Some(ids)
        }
    };
    Ok(Extensions { return_token_ids: w.return_token_ids.unwrap_or(false), truncation, allowed_token_ids })
}

impl Truncation {
    /// The prompt cut to what the request keeps. `max_model_len - max_tokens` (one token when
    /// `max_tokens` was not sent) is the most a prompt may keep, as in vLLM: asking for more is
    /// a 400, and -1 keeps that many.
    pub fn apply(
        &self,
        mut prompt: Vec<u32>,
        max_model_len: usize,
        max_tokens: Option<usize>,
    ) -> Result<Vec<u32>, ApiError> {
        let room = max_model_len.saturating_sub(max_tokens.unwrap_or(1));
        let keep = match self.keep {
            Some(n) if n > room => {
                return Err(ApiError::invalid(
                    "truncate_prompt_tokens",
                    format!(
                        "truncate_prompt_tokens={n} cannot be greater than the context ({max_model_len}) less \
                         max_tokens ({}) = {room}; ask for a smaller truncation",
                        max_tokens.unwrap_or(1)
                    ),
                ))
            }
            Some(n) => n,
            None => room,
        };
        if prompt.len() > keep {
            match self.side {
                Side::Left => {
                    prompt.drain(..prompt.len() - keep);
                }
                Side::Right => prompt.truncate(keep),
            }
        }
        Ok(prompt)
    }
}

/// The peers' fields that would change the answer but have no implementation here.
pub fn refuse_extensions(w: &RefusedExtensionsWire) -> Result<(), ApiError> {
    if w.use_beam_search == Some(true) {
        // Beam search keeps many hypotheses per completion and scores them; the engine samples
        // each completion on its own.
        return Err(unsupported("use_beam_search"));
    }
    if w.logprob_token_ids.is_some() {
        // The device sampler returns the top k alternatives, not the logprobs of chosen ids.
        return Err(unsupported("logprob_token_ids"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::parse_fields;
    use serde_json::json;

    fn ext(v: serde_json::Value) -> Result<Extensions, String> {
        extensions(parse_fields(&v).unwrap(), 512).map_err(|e| e.body()["error"]["param"].as_str().unwrap().to_string())
    }

    #[test]
    fn truncation_keeps_the_side_asked_for() {
        let ids: Vec<u32> = (0..8).collect();
        let t = ext(json!({"truncate_prompt_tokens": 4, "truncation_side": "right"})).unwrap().truncation.unwrap();
        assert_eq!(t.apply(ids.clone(), 100, Some(1)).unwrap(), vec![0, 1, 2, 3]);
        let t = ext(json!({"truncate_prompt_tokens": 4})).unwrap().truncation.unwrap();
        assert_eq!(t.apply(ids.clone(), 100, Some(1)).unwrap(), vec![4, 5, 6, 7], "left is the default");
        // A prompt already short enough is left alone.
        assert_eq!(t.apply(vec![9, 9], 100, None).unwrap(), vec![9, 9]);
    }

    #[test]
    fn minus_one_keeps_what_fits_beside_max_tokens() {
        let t = ext(json!({"truncate_prompt_tokens": -1})).unwrap().truncation.unwrap();
        assert_eq!(t.apply((0..10).collect(), 8, Some(3)).unwrap(), vec![5, 6, 7, 8, 9]);
        assert_eq!(t.apply((0..10).collect(), 8, None).unwrap().len(), 7);
    }

    #[test]
    fn truncation_longer_than_the_room_is_a_400() {
        let t = ext(json!({"truncate_prompt_tokens": 8})).unwrap().truncation.unwrap();
        let err = t.apply((0..10).collect(), 8, Some(1)).unwrap_err();
        assert_eq!(err.body()["error"]["param"], "truncate_prompt_tokens");
        assert!(t.apply((0..10).collect(), 9, Some(1)).is_ok());
    }

    #[test]
    fn bad_values_name_their_field() {
        assert_eq!(ext(json!({"truncate_prompt_tokens": 0})).unwrap_err(), "truncate_prompt_tokens");
        assert_eq!(ext(json!({"truncate_prompt_tokens": -2})).unwrap_err(), "truncate_prompt_tokens");
        assert_eq!(ext(json!({"truncation_side": "middle"})).unwrap_err(), "truncation_side");
        assert_eq!(ext(json!({"allowed_token_ids": []})).unwrap_err(), "allowed_token_ids");
        assert_eq!(ext(json!({"allowed_token_ids": [3, 512]})).unwrap_err(), "allowed_token_ids");
        assert_eq!(ext(json!({"allowed_token_ids": [7, 3, 7]})).unwrap().allowed_token_ids, Some(vec![3, 7]));
    }

    #[test]
    fn refused_fields_are_named() {
        let refused = |v| {
            refuse_extensions(&parse_fields(&v).unwrap())
                .map_err(|e| e.body()["error"]["param"].as_str().unwrap().to_string())
        };
        assert!(refused(json!({"use_beam_search": false})).is_ok());
        assert_eq!(refused(json!({"use_beam_search": true})).unwrap_err(), "use_beam_search");
        assert_eq!(refused(json!({"logprob_token_ids": [5]})).unwrap_err(), "logprob_token_ids");
    }
}
