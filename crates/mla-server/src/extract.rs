//! The request-body extractor every POST endpoint uses, replacing axum's `Json` so that every
//! failure (oversized, unreadable, not JSON, not an object) is an OpenAI error body with the
//! right status instead of axum's plain-text rejection.

use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde_json::Value;

/// The body size limit in force, put into request extensions by the router so the 413 message
/// can state it.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

/// A request body parsed as a JSON object. The field groups are read from it afterwards with
/// `protocol::parse_fields`, so unknown fields are ignored and type errors name their path.
/// Content-Type is not checked: `curl -d` sends a form type, and the body is JSON either way.
pub struct JsonObject(pub Value);

impl<S: Send + Sync> FromRequest<S> for JsonObject {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let limit = req.extensions().get::<BodyLimit>().map(|l| l.0).unwrap_or(0);
        let bytes = Bytes::from_request(req, state).await.map_err(|r| {
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
