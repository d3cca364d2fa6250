//! Chat fields that shape the prompt rather than the sampling: `add_generation_prompt`,
//! `continue_final_message`, `chat_template_kwargs` and `parse_special_tokens_in_content`.

use crate::chat_template::RESERVED_VARIABLES;
use crate::error::ApiError;
use crate::protocol::chat::ChatWire;
use crate::text::ChatPromptOptions;
use serde_json::Value;

/// vLLM's rules: the assistant prompt is appended unless asked not to; continuing the final
/// message excludes it, and needs a final assistant message to continue.
pub fn chat_prompt_options<M>(w: &ChatWire<M>, messages: &[Value]) -> Result<ChatPromptOptions, ApiError> {
    let add_generation_prompt = w.add_generation_prompt.unwrap_or(true);
    let continue_final_message = w.continue_final_message.unwrap_or(false);
    if add_generation_prompt && continue_final_message {
        return Err(ApiError::invalid(
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to true; set `add_generation_prompt: false`",
        ));
    }
    let final_role = messages.last().and_then(|m| m.get("role")).and_then(Value::as_str);
    if continue_final_message && final_role != Some("assistant") {
        return Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` needs the final message to be an assistant message to continue",
        ));
    }
    if w.add_special_tokens == Some(true) {
        return Err(ApiError::invalid(
            "add_special_tokens",
            "`add_special_tokens: true` is not supported for chat: the chat template writes the special tokens",
        ));
    }
    let template_kwargs = match &w.chat_template_kwargs {
        None | Some(Value::Null) => None,
        Some(Value::Object(kwargs)) => {
            if let Some(name) = kwargs.keys().find(|k| RESERVED_VARIABLES.contains(&k.as_str())) {
                return Err(ApiError::invalid(
                    "chat_template_kwargs",
                    format!("chat_template_kwargs cannot set `{name}`: the server sets it from the request"),
                ));
            }
            Some(kwargs.clone())
        }
        Some(_) => return Err(ApiError::invalid("chat_template_kwargs", "chat_template_kwargs must be an object")),
    };
    Ok(ChatPromptOptions {
        add_generation_prompt,
        continue_final_message,
        template_kwargs,
        content_special_tokens: w.parse_special_tokens_in_content.unwrap_or(false),
        // Validated separately (`validate::tools`); the handler fills them in.
        tools: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::parse_fields;
    use serde::de::IgnoredAny;
    use serde_json::json;

    fn options(extra: Value) -> Result<ChatPromptOptions, String> {
        let mut body =
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let w: ChatWire = parse_fields(&body).unwrap();
        let messages: Vec<Value> = body["messages"].as_array().unwrap().clone();
        chat_prompt_options(&w, &messages).map_err(|e| e.body()["error"]["param"].as_str().unwrap().to_string())
    }

    #[test]
    fn defaults_and_continuation() {
        let o = options(json!({})).unwrap();
        assert!(o.add_generation_prompt && !o.continue_final_message && !o.content_special_tokens);
        let o = options(json!({"continue_final_message": true, "add_generation_prompt": false})).unwrap();
        assert!(o.continue_final_message && !o.add_generation_prompt);
    }

    #[test]
    fn refusals_name_the_field() {
        assert_eq!(options(json!({"continue_final_message": true})).unwrap_err(), "continue_final_message");
        assert_eq!(options(json!({"chat_template_kwargs": [1]})).unwrap_err(), "chat_template_kwargs");
        assert_eq!(options(json!({"chat_template_kwargs": {"messages": []}})).unwrap_err(), "chat_template_kwargs");
        let kwargs = options(json!({"chat_template_kwargs": {"thinking": true}})).unwrap().template_kwargs.unwrap();
        assert_eq!(kwargs["thinking"], json!(true));
    }

    #[test]
    fn a_read_that_skips_the_messages_reads_the_rest() {
        // `/tokenize` has read the messages already; its read of the chat fields skips them.
        let body = json!({"messages": [{"role": 5}], "add_generation_prompt": false});
        assert!(parse_fields::<ChatWire>(&body).is_err());
        let w: ChatWire<IgnoredAny> = parse_fields(&body).unwrap();
        assert_eq!(w.add_generation_prompt, Some(false));
        let bad = parse_fields::<ChatWire<IgnoredAny>>(&json!({"messages": [], "logprobs": "yes"})).unwrap_err();
        assert_eq!(bad.body()["error"]["param"], "logprobs");
    }
}
