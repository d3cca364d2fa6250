//! The request-body extractor every POST endpoint uses, replacing axum's `Json` so that every
//! failure (oversized, unreadable, not JSON, not an object) is an OpenAI error body with the
//! right status instead of axum's plain-text rejection.

use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde_json::Value;
use std::time::Duration;

/// The limits on a request body, put into request extensions by the router so the extractor
/// can enforce them and its errors can state them.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    /// Largest body accepted, in bytes (413 above it).
    pub max_bytes: usize,
    /// Time the whole body may take to arrive once the handler asks for it (408 after it): a
    /// client that trickles a body would otherwise hold its connection and task forever.
    pub read_timeout: Duration,
}

/// A request body parsed as a JSON object. The field groups are read from it afterwards with
/// `protocol::parse_fields`, so unknown fields are ignored and type errors name their path.
///
/// The body must come as `Content-Type: application/json` (parameters such as a charset are
/// fine). A web page can send a cross-origin POST without the browser asking first only with a
/// form or text/plain body, so insisting on JSON keeps any page a user visits from making a
/// local server without an API key generate. (`curl -d` needs `-H 'Content-Type:
/// application/json'`, as OpenAI's own examples show.)
pub struct JsonObject(pub Value);

/// Whether a Content-Type header value names JSON.
fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
}

impl<S: Send + Sync> FromRequest<S> for JsonObject {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let content_type = req.headers().get(axum::http::header::CONTENT_TYPE).map(|v| v.to_str().unwrap_or("?"));
        if !content_type.is_some_and(is_json) {
            let got = content_type.map_or("no Content-Type".to_string(), |t| format!("`{t}`"));
            return Err(ApiError::UnsupportedMediaType { got });
        }
        let limits = *req.extensions().get::<BodyLimits>().expect("the router sets the body limits");
        let limit = limits.max_bytes;
        // A declared length over the limit is refused before a byte of the body is read.
        let declared =
            req.headers().get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok());
        if declared.is_some_and(|n: usize| n > limit) {
            return Err(ApiError::PayloadTooLarge { limit });
        }
        let read = tokio::time::timeout(limits.read_timeout, Bytes::from_request(req, state));
        let bytes = read.await.map_err(|_| ApiError::BodyTimeout { seconds: limits.read_timeout.as_secs_f64() })?;
        let bytes = bytes.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge { limit }
            } else {
                ApiError::InvalidJson {
                    message: format!("cannot read the request body: {}", r.body_text()),
                    param: None,
                }
            }
        })?;
        let value: Value = serde_json::from_slice(&bytes).map_err(|e| ApiError::InvalidJson {
            message: format!("the request body is not valid JSON: {e}"),
            param: None,
        })?;
        if !value.is_object() {
            return Err(ApiError::InvalidJson {
                message: "the request body must be a JSON object".into(),
                param: None,
            });
        }
        Ok(JsonObject(value))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn json_content_types_are_recognised_with_parameters_and_any_case() {
        for ok in ["application/json", "application/json; charset=utf-8", "Application/JSON"] {
            assert!(super::is_json(ok), "{ok}");
        }
        for no in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""] {
            assert!(!super::is_json(no), "{no}");
        }
    }
}
