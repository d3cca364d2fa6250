//! `/v1/completions` prompts: a string, strings, token ids, or lists of token ids.

use super::token_id;
use crate::error::ApiError;
use crate::protocol::completions::PromptWire;

#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Tokenized with the tokenizer's special tokens (BOS), as vLLM does for completions.
    Text(String),
    /// Used exactly as sent.
    Tokens(Vec<u32>),
}

pub fn prompt_inputs(w: PromptWire, vocab_size: usize) -> Result<Vec<PromptInput>, ApiError> {
    let empty = || ApiError::invalid("prompt", "prompt must not be empty");
    let inputs: Vec<PromptInput> = match w {
        PromptWire::Text(s) => vec![PromptInput::Text(s)],
        PromptWire::Texts(v) => v.into_iter().map(PromptInput::Text).collect(),
        PromptWire::Tokens(ids) => vec![PromptInput::Tokens(ids_of(ids, "prompt", vocab_size)?)],
        PromptWire::TokenLists(lists) => lists
            .into_iter()
            .enumerate()
            .map(|(i, ids)| ids_of(ids, &format!("prompt[{i}]"), vocab_size).map(PromptInput::Tokens))
            .collect::<Result<_, _>>()?,
    };
    if inputs.is_empty() {
        return Err(empty());
    }
    for (i, p) in inputs.iter().enumerate() {
        let is_empty = match p {
            PromptInput::Text(s) => s.is_empty(),
            PromptInput::Tokens(t) => t.is_empty(),
        };
        if is_empty {
            let field = if inputs.len() == 1 { "prompt".to_string() } else { format!("prompt[{i}]") };
            return Err(ApiError::invalid(field.clone(), format!("{field} must not be empty")));
        }
    }
    Ok(inputs)
}

fn ids_of(ids: Vec<i64>, field: &str, vocab_size: usize) -> Result<Vec<u32>, ApiError> {
    ids.into_iter().map(|t| token_id(field, t, vocab_size)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::parse_fields;
    use serde_json::json;

    fn inputs(v: serde_json::Value) -> Result<Vec<PromptInput>, ApiError> {
        prompt_inputs(parse_fields(&v).unwrap(), 512)
    }

    #[test]
    fn all_four_shapes() {
        assert_eq!(inputs(json!("hi")).unwrap(), vec![PromptInput::Text("hi".into())]);
        assert_eq!(inputs(json!(["a", "b"])).unwrap().len(), 2);
        assert_eq!(inputs(json!([0, 5, 511])).unwrap(), vec![PromptInput::Tokens(vec![0, 5, 511])]);
        assert_eq!(
            inputs(json!([[1, 2], [3]])).unwrap(),
            vec![PromptInput::Tokens(vec![1, 2]), PromptInput::Tokens(vec![3])]
        );
    }

    #[test]
    fn bad_prompts_name_the_field() {
        let param = |v| inputs(v).unwrap_err().body()["error"]["param"].as_str().unwrap().to_string();
        assert_eq!(param(json!("")), "prompt");
        assert_eq!(param(json!([])), "prompt");
        assert_eq!(param(json!([3, 512])), "prompt");
        assert_eq!(param(json!([3, -1])), "prompt");
        assert_eq!(param(json!([[1], []])), "prompt[1]");
        assert_eq!(param(json!([[1], [600]])), "prompt[1]");
    }

    #[test]
    fn other_shapes_are_type_errors() {
        assert!(parse_fields::<PromptWire>(&json!({"a": 1})).is_err());
        assert!(parse_fields::<PromptWire>(&json!([1.5])).is_err());
    }
}
