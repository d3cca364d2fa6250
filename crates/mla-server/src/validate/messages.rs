//! Chat messages -> the message objects the chat template sees (as transformers passes them):
//! `role`, `content` as one string, and `name`, `tool_calls`, `tool_call_id` when sent.
//! Assistant `tool_calls` are checked (each needs `function.name` and `arguments`) and their
//! `arguments` reach the template as a JSON string, which DeepSeek's templates concatenate into the
//! prompt: an object, which some clients send, is serialized as Python's `json.dumps` would (what
//! the OpenAI SDK sends as the string form, so both forms give the same prompt).
//! OpenAI's `developer` role (its newer name for `system`) reaches the template as `system`: the
//! DeepSeek templates know only system, user, assistant and tool, and would drop it silently.
//! Any other role goes to the template as sent, as vLLM passes it: custom templates give roles of
//! their own a meaning (the DeepSeek templates render none for them).

use crate::error::ApiError;
use crate::protocol::chat::{ContentWire, MessageWire};
use crate::python_format::{json_dumps, JsonDumpsOptions};
use serde_json::{Map, Value};

pub fn template_messages(messages: &[MessageWire]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must contain at least one message"));
    }
    messages.iter().enumerate().map(|(i, m)| template_message(i, m)).collect()
}

fn template_message(i: usize, m: &MessageWire) -> Result<Value, ApiError> {
    if m.role.is_empty() {
        return Err(ApiError::invalid(format!("messages[{i}].role"), format!("messages[{i}].role must not be empty")));
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
        obj.insert("tool_calls".into(), template_tool_calls(i, calls)?);
    }
    if let Some(id) = &m.tool_call_id {
        obj.insert("tool_call_id".into(), Value::String(id.clone()));
    }
    Ok(Value::Object(obj))
}

/// Checks a message's `tool_calls` and makes every `arguments` a string.
fn template_tool_calls(i: usize, calls: &Value) -> Result<Value, ApiError> {
    let field = format!("messages[{i}].tool_calls");
    let bad = |f: String, why: &str| Err(ApiError::invalid(f.clone(), format!("{f}: {why}")));
    let list = match calls {
        Value::Null => return Ok(Value::Null),
        Value::Array(list) => list,
        _ => return bad(field, "must be a list of tool calls"),
    };
    let mut out = Vec::with_capacity(list.len());
    for (j, call) in list.iter().enumerate() {
        let at = format!("{field}[{j}]");
        let Some(call) = call.as_object() else { return bad(at, "must be an object") };
        let mut call = call.clone();
        match call.get("type") {
            // OpenAI's only call type; templates print it (V3: `function<｜tool▁sep｜>`).
            None | Some(Value::Null) => {
                call.insert("type".into(), Value::String("function".into()));
            }
            Some(Value::String(t)) if t == "function" => {}
            Some(_) => return bad(format!("{at}.type"), "must be \"function\""),
        }
        if call.get("id").is_some_and(|id| !id.is_null() && !id.is_string()) {
            return bad(format!("{at}.id"), "must be a string");
        }
        let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) else {
            return bad(format!("{at}.function"), "must be an object with name and arguments");
        };
        if function.get("name").and_then(Value::as_str).is_none_or(str::is_empty) {
            return bad(format!("{at}.function.name"), "must be a non-empty string");
        }
        let arguments = match function.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(args @ Value::Object(_)) => {
                let options = JsonDumpsOptions::default();
                json_dumps(&minijinja::Value::from_serialize(args), &options)
                    .map_err(|e| ApiError::invalid(format!("{at}.function.arguments"), e.to_string()))?
            }
            _ => return bad(format!("{at}.function.arguments"), "must be a JSON string or an object"),
        };
        function.insert("arguments".into(), Value::String(arguments));
        out.push(Value::Object(call));
    }
    Ok(Value::Array(out))
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
    fn object_arguments_become_python_json_strings() {
        let out = msgs(json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "function": {"name": "f", "arguments": {"city": "東京", "n": [1, 2.5]}}}]},
        ]))
        .unwrap();
        let call = &out[1]["tool_calls"][0];
        assert_eq!(call["function"]["arguments"], "{\"city\": \"東京\", \"n\": [1, 2.5]}");
        assert_eq!(call["type"], "function");
    }

    #[test]
    fn malformed_tool_calls_name_the_field() {
        let param = |calls: Value| {
            let m = json!([{"role": "assistant", "content": null, "tool_calls": calls}]);
            msgs(m).unwrap_err().body()["error"]["param"].as_str().unwrap().to_string()
        };
        assert_eq!(param(json!({"a": 1})), "messages[0].tool_calls");
        assert_eq!(param(json!(["x"])), "messages[0].tool_calls[0]");
        assert_eq!(param(json!([{"type": "function"}])), "messages[0].tool_calls[0].function");
        assert_eq!(param(json!([{"function": {"arguments": "{}"}}])), "messages[0].tool_calls[0].function.name");
        assert_eq!(param(json!([{"function": {"name": "f"}}])), "messages[0].tool_calls[0].function.arguments");
        assert_eq!(
            param(json!([{"function": {"name": "f", "arguments": 3}}])),
            "messages[0].tool_calls[0].function.arguments"
        );
        assert_eq!(
            param(json!([{"type": "code", "function": {"name": "f", "arguments": "{}"}}])),
            "messages[0].tool_calls[0].type"
        );
    }

    #[test]
    fn developer_is_system_to_the_template() {
        let out =
            msgs(json!([{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}])).unwrap();
        assert_eq!(out[0], json!({"role": "system", "content": "be brief"}));
    }

    #[test]
    fn other_roles_reach_the_template_as_sent() {
        let out = msgs(json!([{"role": "my-custom-role", "content": "aside"}])).unwrap();
        assert_eq!(out[0], json!({"role": "my-custom-role", "content": "aside"}));
    }

    #[test]
    fn bad_messages_name_the_field() {
        let param = |v: Value| msgs(v).unwrap_err().body()["error"]["param"].as_str().unwrap().to_string();
        assert_eq!(param(json!([])), "messages");
        assert_eq!(param(json!([{"role": "", "content": "x"}])), "messages[0].role");
        assert_eq!(param(json!([{"role": "user"}])), "messages[0].content");
        assert_eq!(
            param(json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
            "messages[0].content[0].type"
        );
    }
}
