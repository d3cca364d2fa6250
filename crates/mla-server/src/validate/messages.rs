//! Chat messages -> the message objects the chat template sees (as transformers passes them):
//! `role`, `content` as one string, and `name`, `tool_calls`, `tool_call_id` when sent.
//! OpenAI's `developer` role (its newer name for `system`) reaches the template as `system`: the
//! DeepSeek templates know only system, user, assistant and tool, and would drop it silently.

use crate::error::ApiError;
use crate::protocol::chat::{ContentWire, MessageWire};
use serde_json::{Map, Value};

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

pub fn template_messages(messages: &[MessageWire]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must contain at least one message"));
    }
    messages.iter().enumerate().map(|(i, m)| template_message(i, m)).collect()
}

fn template_message(i: usize, m: &MessageWire) -> Result<Value, ApiError> {
    if !ROLES.contains(&m.role.as_str()) {
        return Err(ApiError::invalid(
            format!("messages[{i}].role"),
            format!("messages[{i}].role: unsupported role \"{}\" (expected one of {})", m.role, ROLES.join(", ")),
        ));
    }
    let content = match &m.content {
        Some(ContentWire::Text(s)) => Value::String(s.clone()),
        Some(ContentWire::Parts(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => texts.push(t.as_str()),
                    ("text", None) => {
                        return Err(ApiError::invalid(format!("messages[{i}].content[{j}].text"), format!("messages[{i}].content[{j}]: a text part needs `text`")))
                    }
                    (other, _) => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}].type"),
                            format!("messages[{i}].content[{j}]: content parts of type \"{other}\" are not supported (text only)"),
                        ))
                    }
                }
            }
            // Several text parts form one message, joined by newlines as vLLM joins them.
            Value::String(texts.join("\n"))
        }
        // The DeepSeek templates test `content is none` to render assistant tool calls.
        None if m.role == "assistant" && m.tool_calls.is_some() => Value::Null,
        None => {
            return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                format!("messages[{i}].content is required for role \"{}\"", m.role),
            ))
        }
    };
    let mut obj = Map::new();
    let role = if m.role == "developer" { "system" } else { m.role.as_str() };
    obj.insert("role".into(), Value::String(role.to_string()));
    obj.insert("content".into(), content);
    if let Some(name) = &m.name {
        obj.insert("name".into(), Value::String(name.clone()));
    }
    if let Some(calls) = &m.tool_calls {
        obj.insert("tool_calls".into(), calls.clone());
    }
    if let Some(id) = &m.tool_call_id {
        obj.insert("tool_call_id".into(), Value::String(id.clone()));
    }
    Ok(Value::Object(obj))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::parse_fields;
    use serde_json::json;

    fn msgs(v: Value) -> Result<Vec<Value>, ApiError> {
        let m: Vec<MessageWire> = parse_fields(&v).unwrap();
        template_messages(&m)
    }

    #[test]
    fn parts_are_joined_and_tool_calls_kept() {
        let out = msgs(json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ]))
        .unwrap();
        assert_eq!(out[1], json!({"role": "user", "content": "a\nb"}));
        assert!(out[2]["content"].is_null());
        assert_eq!(out[2]["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(out[3]["tool_call_id"], "call_1");
    }

    #[test]
    fn developer_is_system_to_the_template() {
        let out =
            msgs(json!([{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}])).unwrap();
        assert_eq!(out[0], json!({"role": "system", "content": "be brief"}));
    }

    #[test]
    fn bad_messages_name_the_field() {
        let param = |v: Value| msgs(v).unwrap_err().body()["error"]["param"].as_str().unwrap().to_string();
        assert_eq!(param(json!([])), "messages");
        assert_eq!(param(json!([{"role": "wizard", "content": "x"}])), "messages[0].role");
        assert_eq!(param(json!([{"role": "user"}])), "messages[0].content");
        assert_eq!(
            param(json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
            "messages[0].content[0].type"
        );
    }
}
