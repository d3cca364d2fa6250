//! `tools`, `tool_choice` and `parallel_tool_calls` of a chat request, checked as vLLM checks
//! them: tools must be OpenAI function tools, a named choice must name one of them, and a
//! `tool_choice` other than "none" needs tools. No `tool_choice` with tools means "auto".

use crate::error::ApiError;
use crate::parsers::grammar::{deepseek_v3_tool_grammar, CallCount};
use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    /// The tools for the chat template (`None`: not sent, or an empty list).
    pub tools: Option<Vec<Value>>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): false reports only the first call.
    pub parallel: bool,
}

impl ToolRequest {
    /// The Lark grammar forcing what `tool_choice` demands, for constrained decoding: one call of
    /// the named function, or one or more calls of any tool for "required" (exactly one when
    /// `parallel_tool_calls` is false). `None` for "none" and "auto", which force nothing.
    pub fn forced_call_grammar(&self) -> Option<String> {
        let tools = self.tools.as_deref().unwrap_or_default();
        match &self.choice {
            ToolChoice::None | ToolChoice::Auto => None,
            ToolChoice::Required => {
                let count = if self.parallel { CallCount::OneOrMore } else { CallCount::One };
                Some(deepseek_v3_tool_grammar(tools, count))
            }
            ToolChoice::Named(name) => {
                let named: Vec<Value> =
                    tools.iter().filter(|t| t["function"]["name"].as_str() == Some(name)).take(1).cloned().collect();
                Some(deepseek_v3_tool_grammar(&named, CallCount::One))
            }
        }
    }
}

pub fn tool_request(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel_tool_calls: Option<&Value>,
    functions: Option<&Value>,
) -> Result<ToolRequest, ApiError> {
    if functions.is_some_and(|f| !f.is_null() && f.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(ApiError::invalid(
            "functions",
            "functions (OpenAI's deprecated function calling) is not supported; send tools instead",
        ));
    }
    let sent = tools.is_some_and(|t| !t.is_null());
    let tools = match tools {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(list)) => list.clone(),
        Some(_) => return Err(ApiError::invalid("tools", "tools must be a list of function tools")),
    };
    for (i, tool) in tools.iter().enumerate() {
        check_tool(i, tool)?;
    }
    let parallel = match parallel_tool_calls {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("parallel_tool_calls", "parallel_tool_calls must be a boolean")),
    };
    let choice = match tool_choice {
        None | Some(Value::Null) if tools.is_empty() => ToolChoice::None,
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => ToolChoice::None,
        Some(_) if !sent => {
            return Err(ApiError::invalid("tool_choice", "tool_choice needs tools: send the tools it may choose from"))
        }
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            // vLLM's rule: nothing to require from an empty list.
            "required" if tools.is_empty() => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice \"{other}\" is not one of \"none\", \"auto\", \"required\" or {NAMED_FORM}"),
                ))
            }
        },
        Some(named) => ToolChoice::Named(named_choice(named, &tools)?),
    };
    Ok(ToolRequest { tools: (!tools.is_empty()).then_some(tools), choice, parallel })
}

const NAMED_FORM: &str = "{\"type\": \"function\", \"function\": {\"name\": \"...\"}}";

fn check_tool(i: usize, tool: &Value) -> Result<(), ApiError> {
    let field = |f: &str| format!("tools[{i}]{f}");
    let bad = |f: &str, why: &str| Err(ApiError::invalid(field(f), format!("{}: {why}", field(f))));
    let Some(obj) = tool.as_object() else { return bad("", "must be an object") };
    match obj.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => return bad(".type", &format!("only \"function\" tools are supported, got \"{other}\"")),
        None => return bad(".type", "must be \"function\""),
    }
    let Some(function) = obj.get("function").and_then(Value::as_object) else {
        return bad(".function", "must be an object with the function's name");
    };
    match function.get("name") {
        Some(Value::String(n)) if !n.is_empty() => {}
        _ => return bad(".function.name", "must be a non-empty string"),
    }
    if function.get("description").is_some_and(|d| !d.is_null() && !d.is_string()) {
        return bad(".function.description", "must be a string");
    }
    if function.get("parameters").is_some_and(|p| !p.is_null() && !p.is_object()) {
        return bad(".function.parameters", "must be a JSON schema object");
    }
    Ok(())
}

fn named_choice(choice: &Value, tools: &[Value]) -> Result<String, ApiError> {
    let usage = || {
        ApiError::invalid(
            "tool_choice",
            format!("tool_choice must be \"none\", \"auto\", \"required\" or {NAMED_FORM}"),
        )
    };
    let obj = choice.as_object().ok_or_else(usage)?;
    if obj.get("type").and_then(Value::as_str) != Some("function") {
        return Err(usage());
    }
    let name = obj.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).filter(|n| !n.is_empty());
    let name = name.ok_or_else(usage)?;
    if !tools.iter().any(|t| t["function"]["name"].as_str() == Some(name)) {
        return Err(ApiError::invalid(
            "tool_choice",
            format!("tool_choice names the function \"{name}\", which is not among the request's tools"),
        ));
    }
    Ok(name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn req(body: Value) -> Result<ToolRequest, ApiError> {
        tool_request(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"), body.get("functions"))
    }

    fn param(body: Value) -> String {
        req(body).unwrap_err().body()["error"]["param"].as_str().unwrap().to_string()
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}})
    }

    #[test]
    fn choices() {
        assert_eq!(req(json!({})).unwrap().choice, ToolChoice::None);
        assert_eq!(req(json!({"tools": [weather()]})).unwrap().choice, ToolChoice::Auto);
        assert_eq!(req(json!({"tools": [weather()], "tool_choice": "none"})).unwrap().choice, ToolChoice::None);
        assert_eq!(req(json!({"tools": [weather()], "tool_choice": "required"})).unwrap().choice, ToolChoice::Required);
        assert_eq!(req(json!({"tools": [], "tool_choice": "required"})).unwrap().choice, ToolChoice::None);
        let named =
            json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
        assert_eq!(req(named).unwrap().choice, ToolChoice::Named("get_weather".into()));
        let r = req(json!({"tools": [weather()], "parallel_tool_calls": false})).unwrap();
        assert!(!r.parallel && r.tools.unwrap().len() == 1);
        assert_eq!(req(json!({"tool_choice": "none"})).unwrap().choice, ToolChoice::None);
    }

    #[test]
    fn forced_call_grammars() {
        let now = json!({"type": "function", "function": {"name": "now"}});
        let tools = json!([weather(), now]);
        assert_eq!(req(json!({"tools": tools})).unwrap().forced_call_grammar(), None);
        let required = req(json!({"tools": tools, "tool_choice": "required"})).unwrap().forced_call_grammar().unwrap();
        assert!(required.contains("call (\"\\n\" call)*") && required.contains("call: call_0 | call_1"), "{required}");
        let one = req(json!({"tools": tools, "tool_choice": "required", "parallel_tool_calls": false})).unwrap();
        assert!(one
            .forced_call_grammar()
            .unwrap()
            .starts_with("start: <｜tool▁calls▁begin｜> call <｜tool▁calls▁end｜>"));
        let named = json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "now"}}});
        let g = req(named).unwrap().forced_call_grammar().unwrap();
        assert!(g.contains("\"now\\n```json\\n\"") && !g.contains("get_weather"), "{g}");
    }

    #[test]
    fn bad_tools_name_the_field() {
        assert_eq!(param(json!({"tools": {"a": 1}})), "tools");
        assert_eq!(param(json!({"tools": [1]})), "tools[0]");
        assert_eq!(param(json!({"tools": [weather(), {"type": "retrieval"}]})), "tools[1].type");
        assert_eq!(param(json!({"tools": [{"type": "function"}]})), "tools[0].function");
        assert_eq!(param(json!({"tools": [{"type": "function", "function": {"name": ""}}]})), "tools[0].function.name");
        assert_eq!(param(json!({"tools": [{"type": "function", "function": {"name": 3}}]})), "tools[0].function.name");
        let bad_schema = json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]});
        assert_eq!(param(bad_schema), "tools[0].function.parameters");
        assert_eq!(param(json!({"tools": [weather()], "tool_choice": "sometimes"})), "tool_choice");
        assert_eq!(param(json!({"tool_choice": "auto"})), "tool_choice");
        let unknown = json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}});
        assert!(req(unknown).unwrap_err().to_string().contains("\"nope\""));
        assert_eq!(
            param(json!({"tools": [weather()], "tool_choice": {"function": {"name": "get_weather"}}})),
            "tool_choice"
        );
        assert_eq!(param(json!({"tools": [weather()], "parallel_tool_calls": "yes"})), "parallel_tool_calls");
        assert_eq!(param(json!({"functions": [{"name": "f"}]})), "functions");
    }
}
