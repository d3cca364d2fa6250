//! Non-streaming responses and error answers of the HTTP layer, over the real engine with a
//! scripted backend (see `common`). Expected texts are decoded from the script independently.

mod common;

use axum::body::Body;
use axum::http::Request;
use common::{demo_tokenizer, server, Options};
use serde_json::json;
use std::time::{Duration, Instant};
use tower::ServiceExt;

fn chat(content: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut body = json!({"model": "demo", "messages": [{"role": "user", "content": content}]});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test]
async fn chat_completion_shape_text_and_usage() {
    let s = server(Options::default());
    let r = s.post("/v1/chat/completions", chat("hi", json!({"max_tokens": 5}))).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], "demo");
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    assert_eq!(c["message"]["content"], s.script_text(5));
    assert_eq!(c["finish_reason"], "length");
    assert!(c["logprobs"].is_null());
    // The V3 template renders one user turn as BOS + <｜User｜> + text + <｜Assistant｜>.
    let prompt = demo_tokenizer().encode("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>", false).unwrap();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": 5, "total_tokens": prompt.len() + 5,
               "prompt_tokens_details": {"cached_tokens": 0},
               "prompt_cache_hit_tokens": 0, "prompt_cache_miss_tokens": prompt.len()})
    );
}

#[tokio::test]
async fn stop_strings_cut_the_text_and_end_with_stop() {
    let s = server(Options::default());
    let r = s.post("/v1/chat/completions", chat("hi", json!({"max_tokens": 40, "stop": ["STOP", "never"]}))).await;
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello there. ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Tokens are counted up to the one that completed the stop string.
    let k = (1..=s.script.len()).find(|&k| s.script_text(k).contains("STOP")).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], k);
}

#[tokio::test]
async fn eos_ends_with_stop_unless_ignored() {
    let mut script = demo_tokenizer().encode("ab", false).unwrap();
    script.push(1); // the demo EOS id
    let s = server(Options { script: script.clone(), ..Options::default() });
    let v = s.post("/v1/chat/completions", chat("x", json!({"max_tokens": 10}))).await.json();
    assert_eq!(v["choices"][0]["message"]["content"], "ab");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], script.len(), "the EOS token is counted");
    let v = s.post("/v1/chat/completions", chat("x", json!({"max_tokens": 4, "ignore_eos": true}))).await.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let v = s
        .post(
            "/v1/chat/completions",
            chat("x", json!({"max_tokens": 4, "ignore_eos": true, "skip_special_tokens": false})),
        )
        .await
        .json();
    let four: Vec<u32> = script.iter().copied().cycle().take(4).collect();
    let expected = demo_tokenizer().decode(&four, false).unwrap();
    assert!(expected.contains("<｜end▁of▁sentence｜>"), "{expected}");
    assert_eq!(v["choices"][0]["message"]["content"], expected);
}

#[tokio::test]
async fn n_choices_and_chat_logprobs() {
    let s = server(Options::default());
    let body = chat("hi", json!({"max_tokens": 4, "n": 2, "logprobs": true, "top_logprobs": 2}));
    let v = s.post("/v1/chat/completions", body).await.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let text = c["message"]["content"].as_str().unwrap();
        let content = c["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 4);
        let joined: String = content.iter().map(|t| t["token"].as_str().unwrap()).collect();
        assert_eq!(joined, text);
        assert_eq!(content[0]["logprob"], -0.5);
        assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(content[0]["bytes"], json!(content[0]["token"].as_str().unwrap().as_bytes()));
    }
    assert_eq!(v["usage"]["completion_tokens"], 8);
}

#[tokio::test]
async fn completions_with_token_prompts_echo_and_logprobs() {
    let s = server(Options::default());
    let v = s.post("/v1/completions", json!({"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3})).await.json();
    assert_eq!(v["object"], "text_completion");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert!(choices.iter().all(|c| c["text"] == s.script_text(3)));
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17, "prompt_tokens_details": {"cached_tokens": 0},
               "prompt_cache_hit_tokens": 0, "prompt_cache_miss_tokens": 5})
    );

    let v = s.post("/v1/completions", json!({"prompt": "Hi", "echo": true, "max_tokens": 2})).await.json();
    assert_eq!(v["choices"][0]["text"], format!("Hi{}", s.script_text(2)));
    // A text prompt gets the tokenizer's BOS, as vLLM does.
    assert_eq!(v["usage"]["prompt_tokens"], demo_tokenizer().encode("Hi", true).unwrap().len());

    let v = s.post("/v1/completions", json!({"prompt": "Hi", "logprobs": 1, "max_tokens": 3})).await.json();
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.concat(), v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(lp["token_logprobs"], json!([-0.5, -0.5, -0.5]));
    let offsets: Vec<usize> = tokens
        .iter()
        .scan(0, |o, t| {
            let at = *o;
            *o += t.chars().count();
            Some(at)
        })
        .collect();
    assert_eq!(lp["text_offset"], json!(offsets));
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 1);

    let body = json!({"prompt": [3, 4], "logprobs": 0, "max_tokens": 3, "return_tokens_as_token_ids": true});
    let v = s.post("/v1/completions", body).await.json();
    let ids: Vec<String> = s.script[..3].iter().map(|t| format!("token_id:{t}")).collect();
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!(ids));
}

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

#[tokio::test]
async fn a_body_that_trickles_past_the_read_timeout_gets_408() {
    let timeout = Duration::from_millis(200);
    let s = server(Options { body_read_timeout: timeout, ..Options::default() });
    // Half a JSON body, then nothing: the client never finishes sending it.
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<axum::body::Bytes, std::io::Error>>(1);
    tx.send(Ok(axum::body::Bytes::from_static(b"{\"prompt\": "))).await.unwrap();
    let body = Body::from_stream(tokio_stream_from(rx));
    let req = Request::post("/v1/completions").header("content-type", "application/json").body(body).unwrap();
    let started = Instant::now();
    let resp =
        tokio::time::timeout(Duration::from_secs(10), s.app.clone().oneshot(req)).await.expect("answered").unwrap();
    assert_eq!(resp.status(), 408);
    assert!(started.elapsed() >= timeout);
    assert_eq!(resp.headers()["connection"], "close");
    drop(tx);
}

/// A body stream from a channel, so a test controls when (and whether) the body ends.
fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test]
async fn api_key_guards_v1_but_not_health_and_metrics() {
    let s = server(Options { api_key: Some("sk-test".into()), ..Options::default() });
    let r = s.call("GET", "/v1/models", None, &[]).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let r = s.call("GET", "/v1/models", None, &[("authorization", "Bearer wrong")]).await;
    assert_eq!(r.status, 401);
    // The scheme is case-insensitive; a different scheme or a bare key is not accepted.
    for (auth, status) in [("bearer sk-test", 200), ("BEARER  sk-test", 200), ("Basic sk-test", 401), ("sk-test", 401)]
    {
        assert_eq!(s.call("GET", "/v1/models", None, &[("authorization", auth)]).await.status, status, "{auth}");
    }
    let r = s.call("GET", "/v1/models", None, &[("authorization", "Bearer sk-test")]).await;
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "demo");
    assert_eq!(v["data"][0]["max_model_len"], common::MAX_MODEL_LEN);
    // vLLM's card fields that its clients read (`vllm bench serve` takes its tokenizer from root).
    assert_eq!(v["data"][0]["root"], "demo");
    assert!(v["data"][0]["parent"].is_null());
    assert_eq!(s.call("GET", "/health", None, &[]).await.status, 200);
    assert_eq!(s.call("GET", "/metrics", None, &[]).await.status, 200);
}

#[tokio::test]
async fn queue_limit_answers_503() {
    let s = server(Options {
        max_queued: 1,
        max_num_seqs: 1,
        delay: std::time::Duration::from_millis(20),
        ..Options::default()
    });
    let body = json!({"prompt": "x", "max_tokens": 30, "ignore_eos": true, "stream": true});
    // Streams are only opened, not read: the first runs, the second waits, the third overflows.
    let first = s.app.clone();
    let req = |b: &serde_json::Value| {
        axum::http::Request::post("/v1/completions")
            .header("content-type", "application/json")
            .body(axum::body::Body::from(b.to_string()))
            .unwrap()
    };
    use tower::ServiceExt;
    let r1 = first.oneshot(req(&body)).await.unwrap();
    assert_eq!(r1.status(), 200);
    while s.engine.stats().running < 1 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let r2 = s.app.clone().oneshot(req(&body)).await.unwrap();
    assert_eq!(r2.status(), 200);
    let r3 = s.post("/v1/completions", body.clone()).await;
    assert_eq!(r3.status, 503, "{}", r3.text);
    assert_eq!(r3.json()["error"]["code"], "queue_full");
    assert_eq!(r3.retry_after.as_deref(), Some("1"), "a full queue says when to come back");
    drop((r1, r2));
}

/// More prompts than the queue can ever hold is the request's fault: 400 naming the limit (a 503
/// would be retried forever by clients such as the openai SDK), and nothing is left queued.
#[tokio::test]
async fn a_request_larger_than_the_queue_is_refused_with_400() {
    let s = server(Options { max_queued: 3, ..Options::default() });
    let r = s.post("/v1/completions", json!({"prompt": ["a", "b", "c", "d"], "max_tokens": 2})).await;
    assert_eq!(r.status, 400, "{}", r.text);
    let e = &r.json()["error"];
    assert_eq!(e["param"], "prompt");
    assert!(e["message"].as_str().unwrap().contains("at most 3 requests"), "{e}");
    assert!(r.retry_after.is_none());
    let ok = s.post("/v1/completions", json!({"prompt": ["a", "b", "c"], "max_tokens": 2})).await;
    assert_eq!(ok.status, 200, "{}", ok.text);
}

/// The `/metrics` sample of `series` with `labels` (after `model_name="demo",`), as a number.
async fn metric(s: &common::TestServer, series: &str, labels: &str) -> f64 {
    let text = s.call("GET", "/metrics", None, &[]).await.text;
    let key = format!("{series}{{model_name=\"demo\"{labels}}} ");
    let line = text.lines().find(|l| l.starts_with(&key)).unwrap_or_else(|| panic!("no {key} in {text}"));
    line[key.len()..].parse().unwrap()
}

async fn wait_idle(s: &common::TestServer) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let st = s.engine.stats();
        if st.running + st.waiting == 0 && st.kv_usage == 0.0 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{st:?}");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_stop_string_ends_its_choice_in_the_engine_and_the_other_runs_on() {
    // Choice 0 says "Hello there. STOP ...", choice 1 never says STOP.
    let sibling = demo_tokenizer().encode("and so on, on and on, ", false).unwrap();
    let s = server(Options {
        sibling_script: Some(sibling.clone()),
        delay: std::time::Duration::from_millis(10),
        ..Options::default()
    });
    let body = json!({"prompt": "x", "n": 2, "max_tokens": 40, "stop": "STOP", "ignore_eos": true});
    let v = s.post("/v1/completions", body).await.json();
    assert_eq!(v["choices"][0]["text"], "Hello there. ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let forty: Vec<u32> = sibling.iter().copied().cycle().take(40).collect();
    assert_eq!(v["choices"][1]["text"], demo_tokenizer().decode(&forty, true).unwrap());
    assert_eq!(v["choices"][1]["finish_reason"], "length");
    let k = (1..=s.script.len()).find(|&k| s.script_text(k).contains("STOP")).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], k + 40);

    wait_idle(&s).await;
    let finished = |reason: &'static str| format!(",finished_reason=\"{reason}\"");
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("stop")).await, 1.0);
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("length")).await, 1.0);
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("abort")).await, 0.0);
    // The request counts once, as truncated: one of its answers is.
    assert_eq!(metric(&s, "mla:request_success_total", &finished("length")).await, 1.0);
    assert_eq!(metric(&s, "mla:request_success_total", &finished("stop")).await, 0.0);
    assert_eq!(metric(&s, "mla:num_requests_running", "").await, 0.0);
    assert_eq!(metric(&s, "mla:kv_cache_usage_perc", "").await, 0.0);
    // Choice 0 was decoded a few steps past its stop string at most, not for all 40 steps
    // its sibling ran (80 tokens in all when the engine only learnt of the stop at the end).
    let generated = metric(&s, "mla:generation_tokens_total", "").await as usize;
    assert!(generated >= k + 40 && generated <= k + 40 + 10, "{generated} tokens generated for {} delivered", k + 40);
}

#[tokio::test]
async fn stop_strings_ending_every_choice_count_as_stops_not_aborts() {
    // Steps take a few milliseconds, as on a GPU, so the server reads each stop-completing token
    // long before the engine would reach max_tokens (see `metrics` for the race when it does not).
    let s = server(Options { delay: std::time::Duration::from_millis(5), ..Options::default() });
    for stream in [false, true] {
        let body =
            json!({"prompt": "x", "n": 3, "max_tokens": 40, "stop": "STOP", "ignore_eos": true, "stream": stream});
        let r = s.post("/v1/completions", body).await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    wait_idle(&s).await;
    let finished = |reason: &'static str| format!(",finished_reason=\"{reason}\"");
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("stop")).await, 6.0);
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("abort")).await, 0.0);
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("length")).await, 0.0);
    assert_eq!(metric(&s, "mla:request_success_total", &finished("stop")).await, 2.0);
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

/// POST bodies must be sent as JSON: a form or text/plain body (what a web page can send
/// cross-origin without asking) gets 415 before anything runs.
#[tokio::test]
async fn post_bodies_must_be_declared_json() {
    let s = server(Options::default());
    let body = json!({"prompt": "x", "max_tokens": 2}).to_string();
    for ct in [None, Some("text/plain"), Some("application/x-www-form-urlencoded")] {
        let headers: Vec<(&str, &str)> = ct.iter().map(|c| ("content-type", *c)).collect();
        let r = s.call("POST", "/v1/completions", Some(&body), &headers).await;
        assert_eq!(r.status, 415, "{ct:?}: {}", r.text);
        assert_eq!(r.json()["error"]["code"], "unsupported_media_type");
    }
    let r =
        s.call("POST", "/v1/completions", Some(&body), &[("content-type", "application/json; charset=utf-8")]).await;
    assert_eq!(r.status, 200, "{}", r.text);
}

/// One request may not need more sequences (prompts x n) than a batch holds: 400 on n naming
/// the limit, instead of taking every slot from other clients for as long as it runs.
#[tokio::test]
async fn prompts_times_n_is_capped_at_the_batch_size() {
    let s = server(Options { max_num_seqs: 8, ..Options::default() });
    let r = s.post("/v1/completions", json!({"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2})).await;
    assert_eq!(r.status, 400, "{}", r.text);
    let e = &r.json()["error"];
    assert_eq!(e["param"], "n");
    assert!(
        e["message"].as_str().unwrap().contains("9 sequences") && e["message"].as_str().unwrap().contains("at most 8"),
        "{e}"
    );
    let ok = s.post("/v1/completions", json!({"prompt": ["a", "b"], "n": 4, "max_tokens": 2})).await;
    assert_eq!(ok.status, 200, "{}", ok.text);
}

#[tokio::test]
async fn health_is_503_while_the_server_drains() {
    let s = common::server(common::Options::default());
    assert_eq!(s.call("GET", "/health", None, &[]).await.status, 200);
    let engine = s.engine.clone();
    tokio::task::spawn_blocking(move || engine.shutdown(std::time::Duration::ZERO)).await.unwrap();
    // A request now would be refused, so a load balancer must see the server as unavailable.
    let r = s.call("GET", "/health", None, &[]).await;
    assert_eq!(r.status, 503);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("shutting down"), "{}", r.json());
}

#[tokio::test]
async fn structured_output_reaches_the_engine_and_bad_grammars_are_400() {
    let mut script = demo_tokenizer().encode("yes", false).unwrap();
    script.push(1); // the demo EOS id
    let s = server(Options { script, ..Options::default() });
    let v = s.post("/v1/chat/completions", chat("x", json!({"max_tokens": 10, "guided_choice": ["yes", "no"]}))).await;
    assert_eq!(v.status, 200, "{}", v.text);
    let v = v.json();
    assert_eq!(v["choices"][0]["message"]["content"], "yes");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // The scripted backend ignores masks: a token off the grammar rejects the request, visibly.
    let r = s.post("/v1/completions", json!({"prompt": "x", "max_tokens": 10, "guided_regex": "no"})).await;
    assert_eq!(r.status, 400, "{}", r.text);
    let message = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(message.starts_with("structured output: "), "{message}");
    let r = s.post("/v1/completions", json!({"prompt": "x", "guided_regex": "("})).await;
    assert_eq!((r.status.as_u16(), r.json()["error"]["param"].clone()), (400, json!("guided_regex")));
    let r = s.post("/v1/chat/completions", chat("x", json!({"guided_regex": "a", "guided_json": {}}))).await;
    assert_eq!(r.status, 400, "{}", r.text);
}

/// Prompt logprobs depend only on the prompt: with several prompts and `n: 2`, the first choice
/// of each prompt reports exactly what a request for its prompt alone with `n: 1` reports in
/// vLLM's `prompt_logprobs` (the others leave it out rather than repeat it), and every choice in
/// the legacy `logprobs` object that `echo` heads with the prompt.
#[tokio::test]
async fn prompt_logprobs_of_n_choices_are_their_prompts() {
    let s = server(Options::default());
    let prompts = [json!([5, 6, 7, 8]), json!([9, 3, 4])];
    let fields = json!({"max_tokens": 3, "prompt_logprobs": 2, "logprobs": 1, "echo": true});
    let with = |prompt: &serde_json::Value, n: usize| {
        let mut body = fields.clone();
        body["prompt"] = prompt.clone();
        body["n"] = json!(n);
        body
    };
    // What a choice reports about its prompt, as the bytes the server sent.
    let reported = |c: &serde_json::Value| (c["prompt_logprobs"].to_string(), c["logprobs"].to_string());
    let mut alone = vec![];
    for (prompt, len) in prompts.iter().zip([4, 3]) {
        let r = s.post("/v1/completions", with(prompt, 1)).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let c = r.json()["choices"][0].clone();
        let list = c["prompt_logprobs"].as_array().unwrap();
        assert_eq!(list.len(), len, "{c}");
        assert!(list[0].is_null() && list[1..].iter().all(|p| p.is_object()), "{c}");
        assert_eq!(c["logprobs"]["tokens"].as_array().unwrap().len(), len + 3, "{c}");
        alone.push(reported(&c));
    }
    assert_ne!(alone[0], alone[1], "the two prompts must be told apart");

    let r = s.post("/v1/completions", with(&json!(prompts), 2)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let v = r.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        // Choices are prompt-major: prompt i owns choices 2i and 2i + 1.
        let (vllm, legacy) = reported(c);
        assert_eq!(legacy, alone[i / 2].1, "choice {i}");
        let once = if i % 2 == 0 { alone[i / 2].0.clone() } else { "null".to_string() };
        assert_eq!(vllm, once, "choice {i}");
        // vLLM's clients read the key on every choice: `null` where the data is not repeated.
        assert!(c.get("prompt_logprobs").is_some(), "choice {i}: the key is always sent");
    }
}

/// `/tokenize` with `messages` counts the prompt that chat would send for the same messages,
/// chat prompt options and tools.
#[tokio::test]
async fn tokenize_messages_counts_the_chat_prompt() {
    let s = server(Options::default());
    let tools = json!([{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]);
    let bodies = [
        json!({"messages": [{"role": "user", "content": "hi"}]}),
        json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "none"}),
        json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
               "add_generation_prompt": false, "continue_final_message": true}),
    ];
    let mut counts = vec![];
    for body in bodies {
        let r = s.post("/tokenize", body.clone()).await;
        assert_eq!(r.status, 200, "{body}: {}", r.text);
        let v = r.json();
        assert_eq!(v["count"], v["tokens"].as_array().unwrap().len());
        let mut chat = body.clone();
        chat["max_tokens"] = json!(1);
        let r = s.post("/v1/chat/completions", chat).await;
        assert_eq!(r.status, 200, "{body}: {}", r.text);
        assert_eq!(v["count"], r.json()["usage"]["prompt_tokens"], "{body}");
        counts.push(v["count"].as_u64().unwrap());
    }
    // (The demo model's V3 template does not render tools; the count equals chat's all the same.)
    assert_ne!(counts[2], counts[0], "the options shape the prompt: {counts:?}");
}

/// `/tokenize` refuses what the generation endpoints refuse: more tokens than the context holds,
/// for a prompt and for messages, counted without tokenizing a long text whole.
#[tokio::test]
async fn tokenize_refuses_prompts_longer_than_the_context() {
    let s = server(Options::default());
    // Byte-level tokens of the demo tokenizer: 'z' is one token, so MAX_MODEL_LEN of them fit
    // with no BOS and one more does not.
    let fits = "z".repeat(common::MAX_MODEL_LEN);
    let r = s.post("/tokenize", json!({"prompt": fits, "add_special_tokens": false})).await;
    assert_eq!((r.status.as_u16(), r.json()["count"].clone()), (200, json!(common::MAX_MODEL_LEN)), "{}", r.text);
    let over = format!("{fits}z");
    let long = "lorem ipsum ".repeat(20_000);
    for body in [
        json!({"prompt": over, "add_special_tokens": false}),
        json!({"prompt": long}),
        json!({"messages": [{"role": "user", "content": long}]}),
    ] {
        let r = s.post("/tokenize", body.clone()).await;
        assert_eq!(r.status, 400, "{}", r.text);
        assert_eq!(r.json()["error"]["code"], "context_length_exceeded", "{body}");
    }
}

/// `/tokenize`'s answers to bad `messages` and chat fields: which one, and what it says.
#[tokio::test]
async fn tokenize_message_errors_name_the_field() {
    let s = server(Options::default());
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"messages": [{"role": 5}]}), "messages[0].role", "field `messages[0].role`: invalid type: integer `5`, expected a string"),
        // The message's type is checked before `prompt` and `messages` are found both sent.
        (json!({"prompt": "x", "messages": [{"role": 5}]}), "messages[0].role", "field `messages[0].role`: invalid type: integer `5`, expected a string"),
        (json!({"prompt": "x", "messages": user}), "prompt", "send exactly one of `prompt` and `messages`"),
        (json!({"messages": []}), "messages", "messages must contain at least one message"),
        // Any other role reaches the template (vLLM's rule); only an empty one is refused.
        (json!({"messages": [{"role": "", "content": "x"}]}), "messages[0].role", "messages[0].role must not be empty"),
        (json!({"messages": user, "add_special_tokens": true}), "add_special_tokens", "`add_special_tokens: true` with `messages` is not supported: the chat template writes the special tokens"),
        // Chat's own fields are read as chat reads them.
        (json!({"messages": user, "logprobs": "yes"}), "logprobs", "field `logprobs`: invalid type: string \"yes\", expected a boolean"),
        (json!({"messages": user, "continue_final_message": true}), "continue_final_message", "Cannot set both `continue_final_message` and `add_generation_prompt` to true; set `add_generation_prompt: false`"),
        (json!({"messages": user, "tools": {}}), "tools", "tools must be a list of function tools"),
    ];
    for (body, param, message) in cases {
        let r = s.post("/tokenize", body.clone()).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text);
        let e = &r.json()["error"];
        assert_eq!((e["param"].as_str(), e["message"].as_str()), (Some(param), Some(message)), "{body}");
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
