//! The access log: one line per request that reaches the router, written when its response has
//! been sent or abandoned, with the status, latency, and for generations the token counts,
//! finish reasons, time to first token and response id. A streamed response the client leaves
//! half way still gets its line (`finish=abort aborted=true`; its 200 was already sent), and so
//! does a request whose client leaves before the response starts (`499 aborted=true`).
//!
//! Connections refused over `--max-connections` and requests hyper cannot parse never reach the
//! router and get no line (see `listener`).

mod body;
mod line;
mod record;

pub use record::{AccessRecord, Fields, GenerationOutcome};

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use body::LoggedBody;
use line::PendingLine;
use std::net::SocketAddr;
use std::sync::Arc;

/// Which lines go to the info log; the others go to the debug log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessLogConfig {
    /// Off: every line at debug level (`--disable-uvicorn-access-log`).
    pub enabled: bool,
    /// Paths whose lines stay at debug level (`--disable-access-log-for-endpoints`): probes
    /// and scrapers call them every few seconds and would drown the requests that matter.
    pub quiet_paths: Vec<String>,
}

impl Default for AccessLogConfig {
    fn default() -> Self {
        AccessLogConfig { enabled: true, quiet_paths: vec!["/health".into(), "/metrics".into()] }
    }
}

impl AccessLogConfig {
    fn loud(&self, path: &str) -> bool {
        self.enabled && !self.quiet_paths.iter().any(|p| p == path)
    }
}

/// The middleware, outermost in the router so CORS preflights and errors of every layer are
/// logged too. Handlers find the request's `AccessRecord` in its extensions.
pub async fn log_access(State(config): State<Arc<AccessLogConfig>>, mut req: Request, next: Next) -> Response {
    let record = AccessRecord::new();
    req.extensions_mut().insert(record.clone());
    // Put there by the listener; absent when the router is called in process (tests).
    let peer = req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
    let loud = config.loud(req.uri().path());
    // Held across the await: if the client leaves before the response exists, this future is
    // dropped and the line is written from here.
    let mut line = PendingLine::new(record, peer, req.method(), req.uri(), loud);
    let resp = next.run(req).await;
    line.responded(resp.status());
    resp.map(|inner| Body::new(LoggedBody::new(inner, line)))
}
