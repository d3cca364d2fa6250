//! Requests the generation endpoints refuse, and how: OpenAI-shaped error bodies with the status
//! and the `param` at fault, for bad values, bodies and paths, messages the chat template cannot
//! render, and fields the server does not support.

use crate::common;

use common::{chat, server, Options};
use serde_json::json;

#[tokio::test]
async fn errors_have_openai_bodies_and_statuses() {
    let s = server(Options { body_limit: 4096, ..Options::default() });
    let cases = [
        (chat("hi", json!({"temperature": 3})), "/v1/chat/completions", 400, Some("temperature")),
        (chat("hi", json!({"top_p": 0})), "/v1/chat/completions", 400, Some("top_p")),
        (chat("hi", json!({"n": 0})), "/v1/chat/completions", 400, Some("n")),
        (chat("hi", json!({"max_tokens": -5})), "/v1/chat/completions", 400, Some("max_tokens")),
        (chat("hi", json!({"model": "gpt-4"})), "/v1/chat/completions", 404, Some("model")),
        (json!({"prompt": [1, 99999]}), "/v1/completions", 400, Some("prompt")),
        (json!({"prompt": {"x": 1}}), "/v1/completions", 400, Some("prompt")),
        (json!({"prompt": "x", "max_tokens": 300}), "/v1/completions", 400, Some("prompt")),
        (json!({"prompt": "x", "temperature": "hot"}), "/v1/completions", 400, Some("temperature")),
        (json!({"messages": "nope"}), "/v1/chat/completions", 400, Some("messages")),
    ];
    for (body, path, status, param) in cases {
        let r = s.post(path, body.clone()).await;
        assert_eq!(r.status, status, "{body}: {}", r.text);
        let e = &r.json()["error"];
        assert!(e["message"].is_string() && e["type"].is_string(), "{}", r.text);
        assert_eq!(e["param"].as_str(), param, "{body}");
    }
    let too_long = s.post("/v1/completions", json!({"prompt": vec![5; 250], "max_tokens": 10})).await;
    let msg = too_long.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("256") && msg.contains("250"), "{msg}");

    for bad in ["{not json", "[1, 2]", ""] {
        let r = s.call("POST", "/v1/chat/completions", Some(bad), &[("content-type", "application/json")]).await;
        assert_eq!(r.status, 400, "{bad:?}");
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    }
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(5000));
    let r = s.call("POST", "/v1/completions", Some(&big), &[("content-type", "application/json")]).await;
    assert_eq!(r.status, 413);
    // A declared Content-Length over the limit is refused before the body is read (here the
    // body never comes: it is the header alone that answers).
    let small = "{\"prompt\": \"a\", \"max_tokens\": 1}";
    let headers = [("content-type", "application/json"), ("content-length", "10000000")];
    let r = s.call("POST", "/v1/completions", Some(small), &headers).await;
    assert_eq!(r.status, 413, "{}", r.text);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("4096"));
    let r = s.call("GET", "/v1/nothing", None, &[]).await;
    assert_eq!((r.status.as_u16(), r.json()["error"]["type"].as_str()), (404, Some("invalid_request_error")));
    let r = s.call("GET", "/v1/chat/completions", None, &[]).await;
    assert_eq!(r.status, 405);
    assert!(r.json()["error"]["message"].is_string());
    // A path segment that does not decode to UTF-8 is a client error in the same shape.
    let r = s.call("GET", "/v1/models/%FF", None, &[]).await;
    assert_eq!((r.status.as_u16(), r.json()["error"]["param"].as_str()), (400, Some("model")), "{}", r.text);
}

/// Messages the template cannot render (an assistant turn with malformed `tool_calls`) are the
/// request's fault: 400 naming the call, not 500.
#[tokio::test]
async fn messages_the_template_cannot_render_are_refused_with_400() {
    let s = server(Options::default());
    for tool_calls in [json!([{"type": "function", "function": 5}]), json!("not a list"), json!([7])] {
        let body = json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "tool_calls": tool_calls},
            {"role": "user", "content": "again"},
        ], "max_tokens": 2});
        let r = s.post("/v1/chat/completions", body).await;
        assert_eq!(r.status, 400, "tool_calls {tool_calls}: {}", r.text);
        let param = r.json()["error"]["param"].as_str().unwrap().to_string();
        assert!(param.starts_with("messages[1].tool_calls"), "{param}");
    }
}

/// Completions refuse what they cannot honour, tools included; chat takes tools (its own
/// checks) and refuses the rest with the same messages.
#[tokio::test]
async fn unsupported_fields_are_refused_by_name() {
    let s = server(Options::default());
    let tool = json!({"type": "function", "function": {"name": "weather"}});
    let refused = |field: &str| (field.to_string(), format!("{field} is not supported by this server"));
    let cases = [
        (json!({"prompt": "x", "tools": [tool]}), refused("tools")),
        (json!({"prompt": "x", "functions": [{"name": "weather"}]}), refused("tools")),
        (json!({"prompt": "x", "tool_choice": "auto"}), refused("tool_choice")),
        (json!({"prompt": "x", "best_of": 2, "tools": [tool]}), refused("best_of")),
        (json!({"prompt": "x", "suffix": "!", "tool_choice": "auto"}), refused("suffix")),
        (json!({"prompt": "x", "tools": [tool], "tool_choice": "auto"}), refused("tools")),
        (
            json!({"prompt": "x", "tools": {}}),
            ("tools".into(), "field `tools`: invalid type: map, expected a sequence".into()),
        ),
        (chat("hi", json!({"best_of": 2})), refused("best_of")),
        (chat("hi", json!({"suffix": "!", "tools": [tool], "tool_choice": "none"})), refused("suffix")),
        (
            chat("hi", json!({"functions": [{"name": "weather"}]})),
            (
                "functions".into(),
                "functions (OpenAI's deprecated function calling) is not supported; send tools instead".into(),
            ),
        ),
    ];
    for (body, (param, message)) in cases {
        let path = if body.get("prompt").is_some() { "/v1/completions" } else { "/v1/chat/completions" };
        let r = s.post(path, body.clone()).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text);
        let e = &r.json()["error"];
        assert_eq!(
            (e["param"].as_str(), e["message"].as_str()),
            (Some(param.as_str()), Some(message.as_str())),
            "{body}"
        );
    }
    // Values that ask for nothing are fine on both.
    let nothing =
        json!({"best_of": 1, "suffix": "", "tools": [], "functions": [], "tool_choice": "none", "max_tokens": 1});
    let mut completion = nothing.clone();
    completion["prompt"] = json!("x");
    let r = s.post("/v1/completions", completion).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = s.post("/v1/chat/completions", chat("hi", nothing)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    // Chat takes the tools it checks itself.
    let r = s
        .post("/v1/chat/completions", chat("hi", json!({"tools": [tool], "tool_choice": "none", "max_tokens": 1})))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
}
