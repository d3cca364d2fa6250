//! Refusals for capacity: a full queue answers 503 with a `Retry-After`, while a request that
//! could never fit (more prompts than the queue holds, more sequences than a batch) is the
//! request's fault, 400 naming the limit.

use crate::common;

use common::{server, Options};
use serde_json::json;

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
