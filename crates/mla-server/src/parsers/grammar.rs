//! Lark grammars (llguidance's dialect) that force DeepSeek-V3-format tool calls, for
//! `tool_choice: "required"` and named tool choice once constrained decoding is wired in.
//!
//! llguidance refers to a tokenizer's added tokens by their text in angle brackets (its docs use
//! `<think>` and `<|python_tag|>`); the DeepSeek markers are such tokens, so the grammar names them
//! as `<｜tool▁sep｜>` etc. and the model must emit the marker token itself, not its spelling in
//! pieces. Arguments are constrained by the tool's JSON schema through `%json { ... }` (a tool
//! without `parameters` gets `{"type": "object"}`, as OpenAI treats it), laid out as Python's
//! `json.dumps` writes JSON. The text between the
//! markers is exactly what the V3 chat template renders for assistant tool calls, so the
//! `deepseek_v3` parser reads the forced output back (tested below).
//!
//! Checked once by hand against llguidance 1.9.1 (its Python wheel) on the demo tokenizer, whose
//! markers are added tokens as in DeepSeek's: both grammars of the tests below validate without
//! warnings; the token ids of a well-formed reply (ending in EOS) are accepted, and arguments
//! violating the schema, an unknown function name, text before the calls, or (for `One`) a
//! second call are rejected.

use super::deepseek_v3::{CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP};
use serde_json::{json, Value};

/// How many calls the grammar admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallCount {
    /// Exactly one (named tool choice, or `parallel_tool_calls: false`).
    One,
    /// One or more, separated by "\n" as the template renders them.
    OneOrMore,
}

/// A grammar for calls of `tools` (OpenAI function tools, already validated: each has
/// `function.name`). For a named tool choice, pass only that tool.
pub fn deepseek_v3_tool_grammar(tools: &[Value], count: CallCount) -> String {
    let mut lark = String::new();
    let calls = match count {
        CallCount::One => "call".to_string(),
        CallCount::OneOrMore => "call (\"\\n\" call)*".to_string(),
    };
    lark.push_str(&format!("start: {} {calls} {}\n", token(CALLS_BEGIN), token(CALLS_END)));
    let alternatives: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    lark.push_str(&format!("call: {}\n", alternatives.join(" | ")));
    for (i, tool) in tools.iter().enumerate() {
        let function = &tool["function"];
        let name = function["name"].as_str().unwrap_or_default();
        let mut schema = match function.get("parameters") {
            Some(p) if p.is_object() => p.clone(),
            _ => json!({"type": "object"}),
        };
        // Arguments laid out as Python's json.dumps writes them (what the template renders for
        // object arguments in the history): no whitespace runs for a model to wander in.
        schema
            .as_object_mut()
            .expect("checked above")
            .entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
        let header = quote(&format!("{name}\n```json\n"));
        lark.push_str(&format!(
            "call_{i}: {} \"function\" {} {header} args_{i} \"\\n```\" {}\n",
            token(CALL_BEGIN),
            token(SEP),
            token(CALL_END)
        ));
        lark.push_str(&format!("args_{i}: %json {schema}\n"));
    }
    lark
}

/// A special-token reference: the token's text in angle brackets is the token's own text here.
fn token(marker: &str) -> &str {
    marker
}

/// A Lark string literal (JSON escaping is a subset Lark reads: `\"`, `\\`, `\n`, `\uXXXX`).
fn quote(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialize")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parsers::deepseek_v3::{DeepSeekToolParser, ToolFormat};

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "now"}}),
        ]
    }

    #[test]
    fn one_or_more_calls_of_any_tool() {
        let g = deepseek_v3_tool_grammar(&tools(), CallCount::OneOrMore);
        let lines: Vec<&str> = g.lines().collect();
        assert_eq!(lines[0], "start: <｜tool▁calls▁begin｜> call (\"\\n\" call)* <｜tool▁calls▁end｜>");
        assert_eq!(lines[1], "call: call_0 | call_1");
        assert_eq!(
            lines[2],
            "call_0: <｜tool▁call▁begin｜> \"function\" <｜tool▁sep｜> \"get_weather\\n```json\\n\" args_0 \"\\n```\" <｜tool▁call▁end｜>"
        );
        let mut schema: Value = serde_json::from_str(lines[3].strip_prefix("args_0: %json ").unwrap()).unwrap();
        let layout = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        assert_eq!(schema.as_object_mut().unwrap().remove("x-guidance"), Some(layout.clone()));
        assert_eq!(schema, tools()[0]["function"]["parameters"]);
        let bare: Value = serde_json::from_str(lines[5].strip_prefix("args_1: %json ").unwrap()).unwrap();
        assert_eq!(bare, json!({"type": "object", "x-guidance": layout}));
        assert_eq!(lines.len(), 6);
    }

    #[test]
    fn exactly_one_call_of_the_named_tool() {
        let g = deepseek_v3_tool_grammar(&tools()[1..], CallCount::One);
        assert!(g.starts_with("start: <｜tool▁calls▁begin｜> call <｜tool▁calls▁end｜>\ncall: call_0\n"));
        assert!(!g.contains("get_weather"));
    }

    #[test]
    fn names_needing_escapes_are_quoted() {
        let tool = json!({"type": "function", "function": {"name": "a\"b\\c"}});
        let g = deepseek_v3_tool_grammar(&[tool], CallCount::One);
        assert!(g.contains(r#""a\"b\\c\n```json\n""#), "{g}");
    }

    /// What the grammar forces is what the parser reads: build a reply from the grammar's pieces.
    #[test]
    fn forced_output_parses_back() {
        let reply = format!(
            "{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{\"city\": \"Rome\"}}\n```{CALL_END}\n{CALL_BEGIN}function{SEP}now\n```json\n{{}}\n```{CALL_END}{CALLS_END}"
        );
        let mut p = DeepSeekToolParser::new(ToolFormat::V3, None);
        let s = p.push(&reply);
        assert_eq!(s.content, "");
        let names: Vec<_> = s.calls.iter().filter_map(|c| c.name.clone()).collect();
        assert_eq!(names, ["get_weather", "now"]);
    }
}
