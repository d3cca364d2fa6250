//! What the HTTP layer answers before a request reaches an endpoint's logic: a body that
//! trickles past the read timeout, a body not declared JSON, a missing or wrong API key, and
//! health while the server drains.

use crate::common;

use axum::body::Body;
use axum::http::Request;
use common::{server, Options};
use serde_json::json;
use std::time::{Duration, Instant};
use tower::ServiceExt;

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
