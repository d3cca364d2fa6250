//! Server-sent events framing for streamed completions, as OpenAI sends them: one `data:` line
//! per JSON chunk, a blank line after each event, and `data: [DONE]` at the end. An error after
//! the stream has started travels as a `data:` event carrying the usual error body.

use crate::error::ApiError;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use futures_util::stream::Stream;
use serde::Serialize;

/// `data: <json>\n\n`. serde_json writes no raw newlines (they are escaped inside strings), so
/// one `data:` line always holds the whole chunk.
pub fn data_event<T: Serialize>(chunk: &T) -> Bytes {
    match serde_json::to_vec(chunk) {
        Ok(json) => frame(&json),
        // Our chunk types always serialize; if one ever does not, the client still gets a
        // well-formed error event instead of a broken stream.
        Err(e) => error_event(&ApiError::Internal(format!("cannot serialize a stream chunk: {e}"))),
    }
}

pub fn error_event(e: &ApiError) -> Bytes {
    frame(e.body().to_string().as_bytes())
}

pub fn done_event() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

fn frame(json: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(json.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(json);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// A streaming response over already framed events. Dropping the body (client gone) drops
/// `events`, which is how aborts reach the engine.
pub fn response<S>(events: S) -> Response
where
    S: Stream<Item = Bytes> + Send + 'static,
{
    use futures_util::StreamExt;
    let body = Body::from_stream(events.map(Ok::<_, std::convert::Infallible>));
    let mut resp = body.into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Tells nginx-style proxies not to buffer the stream.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chunks_are_single_data_lines_even_with_newlines_in_text() {
        let ev = data_event(&json!({"text": "a\nb\n\ndata: x"}));
        let s = std::str::from_utf8(&ev).unwrap();
        assert!(s.starts_with("data: {") && s.ends_with("}\n\n"), "{s:?}");
        assert_eq!(s.matches('\n').count(), 2, "only the event terminator: {s:?}");
        let parsed: serde_json::Value = serde_json::from_str(s.trim_start_matches("data: ").trim_end()).unwrap();
        assert_eq!(parsed["text"], "a\nb\n\ndata: x");
    }

    #[test]
    fn done_and_error_events() {
        assert_eq!(&done_event()[..], b"data: [DONE]\n\n");
        let ev = error_event(&ApiError::Internal("engine failed".into()));
        let s = std::str::from_utf8(&ev).unwrap();
        let v: serde_json::Value = serde_json::from_str(s.strip_prefix("data: ").unwrap().trim_end()).unwrap();
        assert_eq!(v["error"]["type"], "server_error");
        assert!(v["error"]["message"].as_str().unwrap().contains("engine failed"));
    }
}
