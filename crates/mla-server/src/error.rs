//! The one place where failures become HTTP statuses and OpenAI error bodies.
//!
//! Every handler, extractor and middleware returns `ApiError`; nothing else builds an error
//! response, so the status codes and the `{"error": {message, type, param, code}}` shape stay
//! consistent across endpoints and inside SSE streams.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use mla_engine::SubmitError;
use serde_json::{json, Value};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// A field has a value we cannot serve; `param` names the field (JSON path).
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<String> },
    /// The body is not JSON, or not the JSON this endpoint expects.
    #[error("{message}")]
    InvalidJson { message: String, param: Option<String> },
    /// Prompt plus requested output does not fit the context window.
    #[error("this model's maximum context length is {limit} tokens, but the request needs {needed} tokens ({prompt} in the prompt, {completion} for the completion); shorten the prompt or lower max_tokens")]
    ContextTooLong { field: Option<String>, limit: usize, needed: usize, prompt: usize, completion: usize },
    /// A prompt found too long while counting its tokens, before it was tokenized whole.
    #[error("this model's maximum context length is {limit} tokens, but the prompt has more than {counted} tokens; shorten the prompt")]
    PromptTooLong { field: String, limit: usize, counted: usize },
    #[error("missing or invalid API key; send it as `Authorization: Bearer <key>`")]
    Unauthorized,
    #[error("the model `{requested}` does not exist; this server serves `{served}`")]
    ModelNotFound { requested: String, served: String },
    #[error("no route for {method} {path}")]
    RouteNotFound { method: String, path: String },
    #[error("{method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("the request body must be JSON sent as `Content-Type: application/json` (got {got})")]
    UnsupportedMediaType { got: String },
    #[error("the request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("the request queue is full ({limit} requests waiting); retry later")]
    QueueFull { limit: usize },
    #[error("the server is serving its limit of {limit} connections; retry later")]
    TooManyConnections { limit: usize },
    #[error("the request body did not arrive within {seconds} s")]
    BodyTimeout { seconds: f64 },
    #[error("the server is shutting down")]
    ShuttingDown,
    /// A shared resource is in use for now (the grammar compilers, the grammar memory budget):
    /// the same request can succeed later.
    #[error("{0}")]
    Busy(String),
    /// The engine's backend failed for good (a rank died); the server is exiting.
    #[error("the server cannot serve: {0}")]
    Unavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest { message: message.into(), param: Some(param.into()) }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. }
            | ApiError::InvalidJson { .. }
            | ApiError::ContextTooLong { .. }
            | ApiError::PromptTooLong { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound { .. } | ApiError::RouteNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::QueueFull { .. }
            | ApiError::TooManyConnections { .. }
            | ApiError::ShuttingDown
            | ApiError::Busy(_)
            | ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `type`: clients branch on it, so server-side faults are told apart from bad input.
    fn kind(&self) -> &'static str {
        match self {
            ApiError::Unauthorized => "authentication_error",
            ApiError::QueueFull { .. }
            | ApiError::TooManyConnections { .. }
            | ApiError::ShuttingDown
            | ApiError::Busy(_)
            | ApiError::Unavailable(_)
            | ApiError::Internal(_) => "server_error",
            _ => "invalid_request_error",
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            ApiError::InvalidRequest { param, .. } | ApiError::InvalidJson { param, .. } => param.as_deref(),
            ApiError::ContextTooLong { field, .. } => field.as_deref(),
            ApiError::PromptTooLong { field, .. } => Some(field),
            ApiError::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::ContextTooLong { .. } | ApiError::PromptTooLong { .. } => Some("context_length_exceeded"),
            ApiError::Unauthorized => Some("invalid_api_key"),
            ApiError::ModelNotFound { .. } => Some("model_not_found"),
            ApiError::PayloadTooLarge { .. } => Some("request_too_large"),
            ApiError::UnsupportedMediaType { .. } => Some("unsupported_media_type"),
            ApiError::QueueFull { .. } => Some("queue_full"),
            ApiError::Busy(_) => Some("server_busy"),
            ApiError::TooManyConnections { .. } => Some("too_many_connections"),
            ApiError::BodyTimeout { .. } => Some("request_timeout"),
            _ => None,
        }
    }

    /// The JSON error body, also sent as the payload of an SSE error event.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.to_string(),
            "type": self.kind(),
            "param": self.param(),
            "code": self.code(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(status = status.as_u16(), "{self}");
        }
        let mut resp = (status, axum::Json(self.body())).into_response();
        if matches!(self, ApiError::QueueFull { .. } | ApiError::TooManyConnections { .. } | ApiError::Busy(_)) {
            // The queue drains as requests finish: a client may come back soon. (Shutting down
            // and a dead engine get no Retry-After: this server will not take it.)
            resp.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        }
        if matches!(self, ApiError::BodyTimeout { .. }) {
            // The rest of the body may still be on its way: the connection cannot be reused.
            resp.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
        }
        resp
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::QueueFull { limit } => ApiError::QueueFull { limit },
            SubmitError::TooLong { prompt, needed, limit } => ApiError::ContextTooLong {
                field: None,
                limit,
                needed,
                prompt,
                completion: needed.saturating_sub(prompt),
            },
            SubmitError::ExceedsCache { .. } => ApiError::InvalidRequest { message: e.to_string(), param: None },
            SubmitError::Invalid(message) => ApiError::InvalidRequest { message, param: None },
            SubmitError::ShuttingDown => ApiError::ShuttingDown,
            SubmitError::Unavailable(why) => ApiError::Unavailable(why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_openai_conventions() {
        let cases = [
            (ApiError::invalid("temperature", "x"), 400),
            (ApiError::InvalidJson { message: "x".into(), param: None }, 400),
            (ApiError::ContextTooLong { field: None, limit: 8, needed: 9, prompt: 9, completion: 0 }, 400),
            (ApiError::Unauthorized, 401),
            (ApiError::ModelNotFound { requested: "a".into(), served: "b".into() }, 404),
            (ApiError::PayloadTooLarge { limit: 1 }, 413),
            (ApiError::QueueFull { limit: 1 }, 503),
            (ApiError::TooManyConnections { limit: 1 }, 503),
            (ApiError::BodyTimeout { seconds: 1.0 }, 408),
            (ApiError::ShuttingDown, 503),
            (ApiError::Internal("boom".into()), 500),
        ];
        for (e, code) in cases {
            assert_eq!(e.status().as_u16(), code, "{e:?}");
        }
    }

    #[test]
    fn body_has_all_four_fields() {
        let b = ApiError::invalid("top_p", "top_p must be in (0, 1], got 0").body();
        assert_eq!(
            b,
            json!({"error": {"message": "top_p must be in (0, 1], got 0", "type": "invalid_request_error",
                             "param": "top_p", "code": null}})
        );
        let b = ApiError::ModelNotFound { requested: "gpt-4".into(), served: "demo".into() }.body();
        assert_eq!(b["error"]["code"], "model_not_found");
        assert_eq!(b["error"]["param"], "model");
        assert!(b["error"]["message"].as_str().unwrap().contains("gpt-4"));
    }

    #[test]
    fn submit_errors_map_to_statuses_and_keep_the_numbers() {
        let e: ApiError = SubmitError::QueueFull { limit: 3 }.into();
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        let e: ApiError = SubmitError::TooLong { prompt: 100, needed: 120, limit: 64 }.into();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let msg = e.to_string();
        assert!(msg.contains("64") && msg.contains("120") && msg.contains("100"), "{msg}");
        let e: ApiError = SubmitError::ShuttingDown.into();
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
}
