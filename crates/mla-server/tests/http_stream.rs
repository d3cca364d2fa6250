//! Streamed responses: SSE framing, chunk shapes and order, usage chunks, aborts.

use crate::common;

use common::{server, Options};
use serde_json::{json, Value};

fn parse(events: &[String]) -> Vec<Value> {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "the stream ends with [DONE]");
    events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect()
}

#[tokio::test]
async fn chat_stream_role_first_text_then_finish_then_done() {
    let s = server(Options::default());
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": true});
    let r = s.post("/v1/chat/completions", body).await;
    assert_eq!(r.status, 200);
    assert!(r.content_type.starts_with("text/event-stream"));
    let chunks = parse(&r.events());
    // SGLang's clients read `reasoning_content` from every delta: it is there, null.
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": "", "reasoning": null, "reasoning_content": null})
    );
    let id = chunks[0]["id"].clone();
    let mut text = String::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id, "one id for the whole stream");
        assert!(c.get("usage").is_none(), "no usage field unless asked");
        text.push_str(c["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    assert_eq!(text, s.script_text(6));
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
}

#[tokio::test]
async fn usage_chunk_when_asked_and_n_choices_each_finish() {
    let s = server(Options::default());
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let chunks = parse(&s.post("/v1/chat/completions", body).await.events());
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 6);
    assert!(rest.iter().all(|c| c["usage"].is_null() && c.get("usage").is_some()));
    for index in [0, 1] {
        let mine: Vec<&Value> = rest.iter().filter(|c| c["choices"][0]["index"] == index).collect();
        assert_eq!(mine[0]["choices"][0]["delta"]["role"], "assistant");
        let finishes: Vec<&Value> =
            mine.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
        assert_eq!(finishes, vec![&json!("length")]);
    }
}

#[tokio::test]
async fn completion_stream_with_stop_string_and_echo() {
    let s = server(Options::default());
    let body = json!({"prompt": "Say: ", "echo": true, "max_tokens": 40, "stop": "STOP", "stream": true});
    let chunks = parse(&s.post("/v1/completions", body).await.events());
    assert_eq!(chunks[0]["choices"][0]["text"], "Say: ", "echo comes first");
    let text: String = chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(text, "Say: Hello there. ");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
}

#[tokio::test]
async fn errors_before_streaming_are_plain_http_errors() {
    let s = server(Options::default());
    let r = s.post("/v1/completions", json!({"prompt": "x", "stream": true, "top_k": -7})).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "top_k");
}

#[tokio::test]
async fn dropped_streams_free_everything_and_count_as_aborted() {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let s = server(Options { delay: std::time::Duration::from_millis(5), ..Options::default() });
    let body = json!({"prompt": "x", "max_tokens": 200, "ignore_eos": true, "stream": true}).to_string();
    let mut open = vec![];
    for _ in 0..5 {
        let req = axum::http::Request::post("/v1/completions")
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body.clone()))
            .unwrap();
        let mut resp = s.app.clone().oneshot(req).await.unwrap();
        // Read one frame so the request is surely running, then keep the body open.
        resp.body_mut().frame().await.unwrap().unwrap();
        open.push(resp);
    }
    assert!(s.engine.stats().running > 0);
    drop(open);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while s.engine.stats().running + s.engine.stats().waiting > 0 || s.engine.stats().kv_usage > 0.0 {
        assert!(std::time::Instant::now() < deadline, "{:?}", s.engine.stats());
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let metrics = s.call("GET", "/metrics", None, &[]).await.text;
    assert!(
        metrics.contains("mla:request_success_total{model_name=\"demo\",finished_reason=\"abort\"} 5"),
        "{metrics}"
    );
    assert!(metrics.contains("mla:num_requests_running{model_name=\"demo\"} 0"));
}

#[tokio::test]
async fn engine_error_mid_stream_is_an_error_event_before_done() {
    let s = server(Options { fail_after: Some(3), ..Options::default() });
    let body = json!({"prompt": "x", "max_tokens": 10, "ignore_eos": true, "stream": true});
    let events = s.post("/v1/completions", body).await.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(error["error"]["type"], "server_error", "{events:?}");
    assert!(error["error"]["message"].as_str().unwrap().contains("scripted device failure"), "{error}");
    let texts: Vec<Value> = events[..events.len() - 2].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(!texts.is_empty() && texts.iter().all(|c| c["object"] == "text_completion"));
    // Without streaming the same failure is a 500 with an OpenAI error body.
    let r = s.post("/v1/completions", json!({"prompt": "x", "max_tokens": 10, "ignore_eos": true})).await;
    assert_eq!(r.status, 500);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("scripted device failure"));
}

/// Streamed `echo` with `logprobs`: each choice's first chunk heads its `logprobs` with the
/// prompt's, the same for every choice of a prompt as for the prompt alone (`n: 1`).
#[tokio::test]
async fn streamed_echo_logprobs_of_n_choices_are_their_prompts() {
    let s = server(Options::default());
    let prompts = [json!([5, 6, 7, 8]), json!([9, 3, 4])];
    let body = |prompt: &Value, n: usize| json!({"prompt": prompt, "n": n, "max_tokens": 3, "logprobs": 1, "echo": true, "stream": true});
    // Each choice's first chunk, as the bytes the server sent.
    let first_chunks = |chunks: &[Value], n: usize| -> Vec<String> {
        (0..n)
            .map(|i| chunks.iter().find(|c| c["choices"][0]["index"] == i).unwrap()["choices"][0].to_string())
            .collect()
    };
    let mut alone = vec![];
    for (prompt, len) in prompts.iter().zip([4, 3]) {
        let chunks = parse(&s.post("/v1/completions", body(prompt, 1)).await.events());
        let first = first_chunks(&chunks, 1).remove(0);
        let tokens = serde_json::from_str::<Value>(&first).unwrap()["logprobs"]["tokens"].clone();
        assert_eq!(tokens.as_array().unwrap().len(), len + 1, "the prompt's tokens, then the first drawn: {first}");
        alone.push(first);
    }
    assert_ne!(alone[0], alone[1], "the two prompts must be told apart");

    let chunks = parse(&s.post("/v1/completions", body(&json!(prompts), 2)).await.events());
    for (i, first) in first_chunks(&chunks, 4).into_iter().enumerate() {
        // Choices are prompt-major: prompt i owns choices 2i and 2i + 1.
        assert_eq!(first.replace(&format!("\"index\":{i},"), "\"index\":0,"), alone[i / 2], "choice {i}");
    }
}
