//! Accepting HTTP connections with limits a careless or hostile client cannot get around.
//!
//! `axum::serve` accepts without limit and never times a connection out, so a few hundred idle
//! or slow-header connections can take every file descriptor and leave `/health` unanswered.
//! This accept loop serves HTTP/1.1 (what vLLM's uvicorn serves; without TLS nobody needs h2)
//! with three limits:
//! - at most `max_connections` at once: one more is answered `503` with an OpenAI error body
//!   and `Retry-After`, then closed, without reading its request;
//! - a complete request head within `keep_alive` of the connection becoming ready for one (its
//!   opening, or the end of the previous response): hyper runs one deadline from there, so an
//!   idle keep-alive connection and a slow-header (slowloris) one are both closed by it;
//! - request heads of at most `MAX_HEADER_BYTES`;
//! - the body deadline lives in the JSON extractor (`crate::extract`), which knows the request.
//!
//! A request hyper cannot parse (a broken request line or header, an undecodable length) is
//! answered by hyper itself with an empty 400 and closed: no request exists yet to hand to the
//! router, so it cannot carry an OpenAI error body. uvicorn answers those in plain text.
//!
//! On shutdown the loop stops accepting and hands back the open connections, which finish the
//! request they are serving and close (`Connections::close`).

use crate::error::ApiError;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Deadline for a complete request head, counted from when the connection can take one.
    pub keep_alive: Duration,
}

/// Connections being refused at once are not served, but each still holds a descriptor while
/// its 503 is written: this bounds those too, beyond it a connection is closed unanswered.
const MAX_REFUSING: usize = 256;
/// How long a refused connection gets to take its 503 before it is closed.
const REFUSE_LINGER: Duration = Duration::from_secs(1);
/// Request line and headers together (431 above it): generous for any client, and a bound on
/// what a connection buffers before its request is even routed.
const MAX_HEADER_BYTES: usize = 64 << 10;
/// After a failed accept (out of descriptors, say) the loop pauses instead of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The connections still open when the accept loop stopped.
pub struct Connections(GracefulShutdown);

impl Connections {
    /// Tells every connection to close after its current response (idle ones close now);
    /// resolves once all have closed.
    pub async fn close(self) {
        self.0.shutdown().await
    }
}

/// Serves `app` on `listener` until `stop` resolves.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    stop: impl Future<Output = ()>,
) -> Connections {
    let graceful = GracefulShutdown::new();
    let serving = Arc::new(Semaphore::new(limits.max_connections));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.keep_alive).max_header_size(MAX_HEADER_BYTES);
    let mut stop = std::pin::pin!(stop);
    loop {
        let stream = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        // Streams send a token per write: do not let Nagle hold them back.
        let _ = stream.set_nodelay(true);
        let Ok(permit) = serving.clone().try_acquire_owned() else {
            if let Ok(permit) = refusing.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream, limits.max_connections).await;
                    drop(permit);
                });
            }
            continue;
        };
        let conn = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // Timeouts and clients that vanish end here; they are not the server's errors.
            if let Err(e) = conn.await {
                tracing::debug!("connection closed: {e}");
            }
            drop(permit);
        });
    }
    Connections(graceful)
}

/// Answers a connection over the limit with 503 and closes it. The request is not read, but
/// what the client sent is drained for a moment after the answer: closing a socket with unread
/// data resets it, and the client would see a reset instead of the 503.
async fn refuse(mut stream: TcpStream, limit: usize) {
    let body = ApiError::TooManyConnections { limit }.body().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let answer = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        std::io::Result::Ok(())
    };
    let _ = tokio::time::timeout(REFUSE_LINGER, answer).await;
}
