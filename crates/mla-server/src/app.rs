//! The axum router: routes, API-key check, body limit, CORS, the access log, and OpenAI-shaped
//! 404/405 answers.

use crate::access_log::{self, AccessLogConfig};
use crate::error::ApiError;
use crate::extract::BodyLimits;
use crate::routes;
use crate::state::AppState;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, Method, Uri};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Extension, Router};
use std::sync::Arc;
use tower_http::cors::CorsLayer;

/// How the HTTP edge behaves, as the operator configured it.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    pub body: BodyLimits,
    pub access_log: AccessLogConfig,
    /// None: no CORS headers at all (`--allowed-origins` not given).
    pub cors: Option<CorsLayer>,
}

/// Builds the whole HTTP application. `/health` and `/metrics` stay open when an API key is set,
/// so probes and scrapers need no secret (as in vLLM).
pub fn router(state: Arc<AppState>, options: HttpOptions) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(routes::chat::handle))
        .route("/v1/completions", post(routes::completions::handle))
        .route("/v1/models", get(routes::info::list_models))
        .route("/v1/models/{id}", get(routes::info::get_model))
        .route("/tokenize", post(routes::tokenize::tokenize))
        .route("/detokenize", post(routes::tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    let app = Router::new()
        .merge(v1)
        .route("/health", get(routes::info::health))
        .route("/metrics", get(routes::info::metrics))
        .route("/version", get(routes::tokenize::version))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(options.body.max_bytes))
        .layer(Extension(options.body));
    // Outside the API-key check: preflights carry no key, and a page must be able to read a 401.
    let app = match options.cors {
        Some(cors) => app.layer(cors),
        None => app,
    };
    // Outermost, so preflights and every layer's errors get their line too.
    app.layer(middleware::from_fn_with_state(Arc::new(options.access_log), access_log::log_access)).with_state(state)
}

async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Result<Response, ApiError> {
    if let Some(key) = &state.api_key {
        let sent = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim_start().split_once(' '))
            // The scheme is case-insensitive (RFC 9110): `bearer` and `BEARER` are Bearer too.
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        if !sent.is_some_and(|s| constant_time_eq(s.as_bytes(), key.as_bytes())) {
            return Err(ApiError::Unauthorized);
        }
    }
    Ok(next.run(req).await)
}

/// Compares without an early exit, so response timing does not reveal how much of a key matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::RouteNotFound { method: method.to_string(), path: uri.path().to_string() }
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed { method: method.to_string(), path: uri.path().to_string() }
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret1"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
