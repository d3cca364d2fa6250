//! Reasoning and tool calls through the HTTP layer, over a scripted backend that "generates" a
//! fixed DeepSeek reply token by token: the non-streamed message, the streamed deltas (which must
//! add up to the same message and never show marker text), finish reasons and usage.

use crate::common;

use common::{demo_tokenizer, server, Options, TestServer};
use mla_server::parsers::{ParserConfig, ReasoningParserKind, ToolParserKind};
use serde_json::{json, Value};

const CALL: &str =
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>";

fn reply() -> String {
    format!("Let me think.\n</think>\n\nChecking.<｜tool▁calls▁begin｜>{CALL}<｜tool▁calls▁end｜>")
}

fn scripted(text: &str, parsers: ParserConfig) -> TestServer {
    let mut script = demo_tokenizer().encode(text, false).unwrap();
    script.push(1); // end of sentence: the reply stops there
    server(Options { script, parsers, ..Options::default() })
}

fn all_parsers() -> ParserConfig {
    ParserConfig {
        reasoning: Some(ReasoningParserKind::DeepSeekR1),
        tool_call: Some(ToolParserKind::DeepSeekV3),
        enable_auto_tool_choice: true,
    }
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
}

fn request(stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": "weather?"}], "tools": tools(), "max_tokens": 200, "stream": stream})
}

fn chunks(text: &str) -> Vec<Value> {
    let events: Vec<&str> = text.split_terminator("\n\n").map(|e| e.strip_prefix("data: ").unwrap()).collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect()
}

#[tokio::test]
async fn reasoning_content_and_a_tool_call() {
    let s = scripted(&reply(), all_parsers());
    let r = s.post("/v1/chat/completions", request(false)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let body = r.json();
    let choice = &body["choices"][0];
    let message = &choice["message"];
    assert_eq!(message["reasoning_content"], "Let me think.\n");
    assert_eq!(message["content"], "\n\nChecking.");
    let call = &message["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"], json!({"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}));
    assert_eq!(choice["finish_reason"], "tool_calls");
    let tokens = demo_tokenizer().encode(&reply(), false).unwrap().len() + 1;
    assert_eq!(body["usage"]["completion_tokens"], tokens, "usage counts what was generated");
}

#[tokio::test]
async fn streamed_deltas_add_up_to_the_message() {
    let s = scripted(&reply(), all_parsers());
    let r = s.post("/v1/chat/completions", request(true)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let (mut reasoning, mut content, mut name, mut args, mut ids) =
        (String::new(), String::new(), None, String::new(), vec![]);
    let mut finish = vec![];
    for c in chunks(&r.text) {
        let choice = &c["choices"][0];
        let delta = &choice["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(delta["content"].as_str().unwrap_or(""));
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(call["index"], 0);
            if let Some(id) = call.get("id") {
                ids.push(id.clone());
                assert_eq!(call["type"], "function");
                name = call["function"]["name"].as_str().map(str::to_string);
            }
            args.push_str(call["function"]["arguments"].as_str().unwrap());
        }
        for text in [&delta["reasoning_content"], &delta["content"]] {
            assert!(!text.as_str().unwrap_or("").contains('｜'), "marker text leaked: {c}");
        }
        if !choice["finish_reason"].is_null() {
            finish.push(choice["finish_reason"].clone());
        }
    }
    assert_eq!(reasoning, "Let me think.\n");
    assert_eq!(content, "\n\nChecking.");
    assert_eq!((name.as_deref(), args.as_str()), (Some("get_weather"), "{\"city\": \"Paris\"}"));
    assert_eq!(ids.len(), 1, "the id comes once, with the name");
    assert_eq!(finish, vec![json!("tool_calls")]);
}

#[tokio::test]
async fn without_parsers_the_text_is_content_as_before() {
    let s = scripted(&reply(), ParserConfig::default());
    let mut body = request(false);
    body["tool_choice"] = json!("none");
    let r = s.post("/v1/chat/completions", body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let message = &r.json()["choices"][0]["message"];
    assert_eq!(message["content"], reply());
    // The reasoning keys are sent (`null`) whether a parser runs or not, as SGLang and vLLM do.
    assert!(message["reasoning_content"].is_null() && message["reasoning"].is_null(), "{message}");
    assert!(message.get("tool_calls").is_none(), "{message}");
}

/// The reasoning as a request asks for it: vLLM's `include_reasoning`, SGLang's
/// `separate_reasoning` and `stream_reasoning`, over the same scripted reply.
#[tokio::test]
async fn reasoning_options_of_the_request() {
    let s = scripted(&reply(), all_parsers());
    let with = |extra: Value| {
        let mut body = request(false);
        body["tool_choice"] = json!("none");
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let message = |r: common::Reply| r.json()["choices"][0]["message"].clone();
    let m = message(s.post("/v1/chat/completions", with(json!({}))).await);
    assert_eq!((&m["reasoning"], &m["reasoning_content"]), (&json!("Let me think.\n"), &json!("Let me think.\n")));
    let m = message(s.post("/v1/chat/completions", with(json!({"include_reasoning": false}))).await);
    assert!(m["reasoning"].is_null() && m["reasoning_content"].is_null(), "{m}");
    assert!(m["content"].as_str().unwrap().starts_with("\n\nChecking."), "{m}");
    let m = message(s.post("/v1/chat/completions", with(json!({"separate_reasoning": false}))).await);
    assert_eq!(m["content"], reply(), "the thinking stays in the content, unsplit");
    assert!(m["reasoning_content"].is_null());

    // Streamed in pieces (one per token) by default; in one piece, once complete, when asked.
    let mut streamed = with(json!({"stream_reasoning": false}));
    streamed["stream"] = json!(true);
    let r = s.post("/v1/chat/completions", streamed).await;
    let pieces: Vec<Value> = chunks(&r.text)
        .iter()
        .filter_map(|c| c["choices"].get(0).map(|ch| ch["delta"]["reasoning_content"].clone()))
        .filter(|v| !v.is_null())
        .collect();
    assert_eq!(pieces, vec![json!("Let me think.\n")]);
}

#[tokio::test]
async fn tool_choice_none_parses_no_calls_but_reasoning_still_splits() {
    let s = scripted(&reply(), all_parsers());
    let mut body = request(false);
    body["tool_choice"] = json!("none");
    let r = s.post("/v1/chat/completions", body).await;
    let choice = &r.json()["choices"][0];
    assert_eq!(choice["message"]["reasoning_content"], "Let me think.\n");
    assert!(choice["message"]["content"].as_str().unwrap().contains("<｜tool▁calls▁begin｜>"));
    assert_eq!(choice["finish_reason"], "stop");
}

#[tokio::test]
async fn auto_needs_the_flags_and_a_forced_call_takes_no_other_constraint() {
    let s = scripted(&reply(), ParserConfig::default());
    let r = s.post("/v1/chat/completions", request(false)).await;
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("--enable-auto-tool-choice"), "{}", r.text);
    let s = scripted(&reply(), all_parsers());
    let mut body = request(false);
    body["tool_choice"] = json!("required");
    body["response_format"] = json!({"type": "json_object"});
    let r = s.post("/v1/chat/completions", body).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "response_format", "{}", r.text);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("tool_choice"), "{}", r.text);
}

#[tokio::test]
async fn parallel_tool_calls_false_reports_the_first_call_only() {
    let text = format!("<｜tool▁calls▁begin｜>{CALL}\n{CALL}<｜tool▁calls▁end｜>");
    let s = scripted(&text, all_parsers());
    let mut body = request(false);
    body["parallel_tool_calls"] = json!(true);
    let both = s.post("/v1/chat/completions", body.clone()).await.json();
    // The reply starts inside the thinking block and never leaves it: all reasoning.
    assert!(both["choices"][0]["message"]["content"].is_null());
    let s = scripted(&format!("</think>{text}"), all_parsers());
    let both = s.post("/v1/chat/completions", body.clone()).await.json();
    assert_eq!(both["choices"][0]["message"]["tool_calls"].as_array().unwrap().len(), 2);
    assert!(both["choices"][0]["message"]["content"].is_null(), "no content: null, as OpenAI");
    body["parallel_tool_calls"] = json!(false);
    let one = s.post("/v1/chat/completions", body).await.json();
    assert_eq!(one["choices"][0]["message"]["tool_calls"].as_array().unwrap().len(), 1);
}

/// Stop strings apply to the generated text first (as without parsers); the parsers see only
/// what is left: here the stop string ends the reply before its tool call.
#[tokio::test]
async fn stop_strings_cut_before_parsing() {
    let s = scripted(&reply(), all_parsers());
    let mut body = request(false);
    body["stop"] = json!("Checking");
    let choice = s.post("/v1/chat/completions", body).await.json()["choices"][0].clone();
    assert_eq!(choice["message"]["reasoning_content"], "Let me think.\n");
    assert_eq!(choice["message"]["content"], "\n\n");
    assert!(choice["message"].get("tool_calls").is_none());
    assert_eq!(choice["finish_reason"], "stop");
}
