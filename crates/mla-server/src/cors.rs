//! CORS, for web pages on other origins that call the API from a browser (`--allowed-origins`).
//! Off unless configured: without it no CORS header is sent and browsers keep other origins'
//! pages from reading any answer.
//!
//! The rules follow Starlette's CORSMiddleware, which vLLM uses, so vLLM's flag values mean the
//! same here: `*` in a list allows anything (with credentials allowed, the request's own origin,
//! method or headers are echoed instead, since browsers refuse `*` together with credentials);
//! the CORS-safelisted request headers are always allowed, Content-Type among them, so a list
//! naming only `Authorization` still lets a page post JSON; preflight answers may be cached for
//! 600 s. One difference: a preflight from an origin not allowed gets a 200 without CORS headers
//! (Starlette answers 400); the browser refuses the request either way.

use axum::http::{HeaderName, HeaderValue, Method};
use std::time::Duration;
use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin};

/// The layer `app::router` takes, re-exported so callers need no tower-http of their own.
pub use tower_http::cors::CorsLayer;

/// What the operator allowed; `*` anywhere in a list stands for anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorsPolicy {
    pub origins: Vec<String>,
    pub methods: Vec<String>,
    pub headers: Vec<String>,
    pub credentials: bool,
}

/// Headers a page may send without naming them (Starlette's list).
const ALWAYS_ALLOWED_HEADERS: [&str; 4] = ["accept", "accept-language", "content-language", "content-type"];
const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(600);

impl CorsPolicy {
    /// The layer for this policy, or what is wrong with one of its values.
    pub fn layer(&self) -> Result<CorsLayer, String> {
        let any = |list: &[String]| list.iter().any(|v| v == "*");
        let origin = if any(&self.origins) {
            if self.credentials {
                AllowOrigin::mirror_request()
            } else {
                AllowOrigin::any()
            }
        } else {
            AllowOrigin::list(self.origins.iter().map(|o| origin(o)).collect::<Result<Vec<_>, _>>()?)
        };
        let methods = if any(&self.methods) {
            if self.credentials {
                AllowMethods::mirror_request()
            } else {
                AllowMethods::any()
            }
        } else {
            AllowMethods::list(self.methods.iter().map(|m| method(m)).collect::<Result<Vec<_>, _>>()?)
        };
        let headers = if any(&self.headers) {
            if self.credentials {
                AllowHeaders::mirror_request()
            } else {
                AllowHeaders::any()
            }
        } else {
            let named = self.headers.iter().map(String::as_str).chain(ALWAYS_ALLOWED_HEADERS);
            AllowHeaders::list(named.map(header).collect::<Result<Vec<_>, _>>()?)
        };
        Ok(CorsLayer::new()
            .allow_origin(origin)
            .allow_methods(methods)
            .allow_headers(headers)
            .allow_credentials(self.credentials)
            .max_age(PREFLIGHT_MAX_AGE))
    }
}

/// An origin is what a browser sends in `Origin`: scheme, host and port, no path. A trailing
/// slash or a path would never match one, silently, so it is refused here.
fn origin(value: &str) -> Result<HeaderValue, String> {
    let well_formed = value == "null"
        || value
            .split_once("://")
            .is_some_and(|(scheme, rest)| !scheme.is_empty() && !rest.is_empty() && !rest.contains(['/', '?', '#']));
    match HeaderValue::from_str(value) {
        Ok(v) if well_formed => Ok(v),
        _ => Err(format!("{value:?} is not an origin; an origin is scheme://host[:port], e.g. https://app.example")),
    }
}

/// Methods are case-sensitive on the wire, but browsers upper-case the standard ones and every
/// vLLM example writes them so: `post` means POST.
fn method(value: &str) -> Result<Method, String> {
    Method::from_bytes(value.to_ascii_uppercase().as_bytes()).map_err(|_| format!("{value:?} is not an HTTP method"))
}

fn header(value: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(value.as_bytes()).map_err(|_| format!("{value:?} is not an HTTP header name"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(origins: &[&str], credentials: bool) -> CorsPolicy {
        let list = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        CorsPolicy { origins: list(origins), methods: list(&["*"]), headers: list(&["*"]), credentials }
    }

    #[test]
    fn origins_must_be_scheme_host_port() {
        assert!(policy(&["https://a.example", "http://localhost:3000", "null"], false).layer().is_ok());
        for bad in ["https://a.example/", "a.example", "https://a.example/app", "://x", "https://a\nb"] {
            let err = policy(&[bad], false).layer().unwrap_err();
            assert!(err.contains("is not an origin"), "{bad}: {err}");
        }
    }

    #[test]
    fn wildcards_with_credentials_are_usable() {
        // tower-http refuses `*` with credentials by panicking when the layer first serves;
        // building the service and polling it for readiness is where that would show.
        use tower::{Layer, Service};
        let layer = policy(&["*"], true).layer().unwrap();
        let mut svc = layer.layer(tower::service_fn(|_: axum::http::Request<axum::body::Body>| async {
            Ok::<_, std::convert::Infallible>(axum::http::Response::new(axum::body::Body::empty()))
        }));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(svc.poll_ready(&mut cx).is_ready());
    }
}
