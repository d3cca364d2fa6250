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
//! Connections close lingering (`linger`), so a client still sending a body the server refused
//! reads the answer instead of a reset. On shutdown the loop stops accepting and hands back the
//! open connections, which finish the request they are serving and close (`Connections::close`).

use crate::error::ApiError;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

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
/// How long a closing connection's unread input is drained at most (`linger`; a client that
/// closes its side ends it at once), and how long a refused one gets to take its 503. Long
/// enough for a client still uploading a refused body of tens of MB to reach its read.
const LINGER: Duration = Duration::from_secs(5);
/// A lingering close ends once the client has sent nothing for this long: a client still
/// uploading a refused body sends more well within it, while an idle keep-alive connection (a
/// pooled client's, closed by shutdown) sends nothing and used to hold shutdown for all of
/// `LINGER`.
const LINGER_QUIET: Duration = Duration::from_millis(500);
/// Request line and headers together (431 above it): generous for any client, and a bound on
/// what a connection buffers before its request is even routed.
const MAX_HEADER_BYTES: usize = 64 << 10;
/// After a failed accept (out of descriptors, say) the loop pauses instead of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// How many connections the server holds open now (served ones, within `--max-connections`;
/// refused ones are not counted), for `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct OpenConnections(Arc<AtomicUsize>);

impl OpenConnections {
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// The connections still open when the accept loop stopped.
pub struct Connections {
    closing: watch::Sender<bool>,
    serving: Arc<Semaphore>,
    max: u32,
}

impl Connections {
    /// Tells every connection to close after its current response (idle ones close now);
    /// resolves once all have closed.
    pub async fn close(self) {
        let _ = self.closing.send(true);
        // Every connection holds a permit until it is closed.
        let _ = self.serving.acquire_many(self.max).await;
    }
}

/// Serves `app` on `listener` until `stop` resolves.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    open: OpenConnections,
    stop: impl Future<Output = ()>,
) -> Connections {
    let max = u32::try_from(limits.max_connections).unwrap_or(u32::MAX).min(Semaphore::MAX_PERMITS as u32);
    let serving = Arc::new(Semaphore::new(max as usize));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let (closing, _) = watch::channel(false);
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.keep_alive).max_header_size(MAX_HEADER_BYTES);
    let mut stop = std::pin::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
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
        let (http, app, closing, open) = (http.clone(), app.clone(), closing.subscribe(), open.clone());
        // Counted while the permit is held: the count never exceeds the cap.
        open.0.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            serve_connection(stream, peer, &http, app, closing).await;
            open.0.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        });
    }
    Connections { closing, serving, max }
}

/// Serves one connection until it ends, then closes it lingering (`linger`).
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    http: &http1::Builder,
    app: Router,
    mut closing: watch::Receiver<bool>,
) {
    // A boxed future keeps the connection `Unpin`, which taking the socket back at the end needs.
    let service = service_fn(move |req: Request<Incoming>| {
        let app = app.clone();
        let mut req = req.map(Body::new);
        // The client's address, for the access log (axum's own `serve` puts it there too).
        req.extensions_mut().insert(ConnectInfo(peer));
        Box::pin(async move { app.oneshot(req).await })
    });
    let mut conn = http.serve_connection(TokioIo::new(stream), service);
    let mut told = false;
    let ended = loop {
        tokio::select! {
            ended = poll_fn(|cx| conn.poll_without_shutdown(cx)) => break ended,
            _ = closing.wait_for(|&c| c), if !told => {
                // Finish the response in progress, take no further request.
                std::pin::Pin::new(&mut conn).graceful_shutdown();
                told = true;
            }
        }
    };
    // Timeouts and clients that vanish end here; they are not the server's errors.
    if let Err(e) = ended {
        tracing::debug!("connection closed: {e}");
    }
    linger(conn.into_parts().io.into_inner()).await;
}

/// Closes a connection without resetting it: closing a socket that still has unread data (the
/// rest of a body refused with 413, a request the client pipelined) sends a reset, which can
/// destroy the answer before the client reads it. So the sending side is shut first and what
/// the client still sends is drained for a moment, as nginx's lingering close does (its
/// `lingering_timeout` is our `LINGER_QUIET`, its `lingering_time` our `LINGER`).
async fn linger(mut stream: TcpStream) {
    let drain = async {
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        // Until the client closes its side, goes quiet, or `LINGER` is over.
        while let Ok(read) = tokio::time::timeout(LINGER_QUIET, stream.read(&mut sink)).await {
            if read? == 0 {
                break;
            }
        }
        std::io::Result::Ok(())
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}

/// Answers a connection over the limit with 503 and closes it, lingering: the request is not
/// read.
async fn refuse(mut stream: TcpStream, limit: usize) {
    let body = ApiError::TooManyConnections { limit }.body().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let answer = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await
    };
    if tokio::time::timeout(LINGER, answer).await.is_ok() {
        linger(stream).await;
    }
}
