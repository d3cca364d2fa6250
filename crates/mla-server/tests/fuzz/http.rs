//! Sending a request through the router in process and reading its whole answer, and the checks
//! every answer must pass (OpenAI's error object, SSE framing).

use crate::common::{server, Options, TestServer};
use axum::body::Body;
use axum::http::Request;
use http_body_util::BodyExt;
use proptest::prelude::*;
use serde_json::Value;
use tower::ServiceExt;

pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn shown(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn is_stream(&self) -> bool {
        self.content_type.starts_with("text/event-stream")
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// A router over the scripted engine whose every completion emits `script` (demo ids), cycled.
pub fn scripted(script: Vec<u32>) -> TestServer {
    runtime().block_on(async { server(Options { script, ..Options::default() }) })
}

pub fn endpoint(chat: bool) -> &'static str {
    if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

/// POSTs `body` as JSON and reads the whole answer, streams included.
pub fn post(s: &TestServer, path: &str, body: Vec<u8>) -> Answer {
    let req = Request::post(path).header("content-type", "application/json").body(Body::from(body)).unwrap();
    runtime().block_on(async {
        let resp = s.app.clone().oneshot(req).await.unwrap();
        let status = resp.status().as_u16();
        let content_type =
            resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
        let body = resp.into_body().collect().await.unwrap().to_bytes().to_vec();
        Answer { status, content_type, body }
    })
}

pub fn parse_json(bytes: &[u8]) -> Result<Value, TestCaseError> {
    serde_json::from_slice(bytes).map_err(|e| TestCaseError::fail(format!("{e}: {:?}", String::from_utf8_lossy(bytes))))
}

/// OpenAI's error object, exactly: `{"error": {"message": str, "type": str, "param": str|null,
/// "code": str|null}}` (`error.rs`).
pub fn check_error_body(v: &Value) -> Result<(), TestCaseError> {
    prop_assert!(v.as_object().is_some_and(|o| o.len() == 1), "not an error body: {}", v);
    let e = v.get("error").and_then(Value::as_object);
    prop_assert!(e.is_some_and(|e| e.len() == 4), "not an error body: {}", v);
    let e = e.unwrap();
    prop_assert!(e.get("message").is_some_and(Value::is_string), "{}", v);
    prop_assert!(e.get("type").is_some_and(Value::is_string), "{}", v);
    for key in ["param", "code"] {
        prop_assert!(e.get(key).is_some_and(|p| p.is_string() || p.is_null()), "`{}` in {}", key, v);
    }
    Ok(())
}

/// The JSON payloads of an SSE body, which must be one-line `data: <json>` events followed by
/// `data: [DONE]`.
pub fn stream_events(body: &[u8]) -> Result<Vec<Value>, TestCaseError> {
    let text = std::str::from_utf8(body).map_err(|e| TestCaseError::fail(format!("stream not UTF-8: {e}")))?;
    prop_assert!(text.ends_with("data: [DONE]\n\n"), "stream not terminated: {:?}", text);
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    let (_, chunks) = events.split_last().expect("ends with [DONE]");
    chunks
        .iter()
        .map(|e| {
            let json =
                e.strip_prefix("data: ").ok_or_else(|| TestCaseError::fail(format!("not a data event: {e:?}")))?;
            prop_assert!(!json.contains('\n'), "an event spans lines: {:?}", e);
            parse_json(json.as_bytes())
        })
        .collect()
}
