//! Serving until a signal, then shutting down in bounded time: stop accepting connections,
//! let in-flight requests finish for `--shutdown-timeout` seconds, abort the rest, exit 0.

use crate::cli::Args;
use crate::startup::Started;
use mla_server::app::{router, DEFAULT_BODY_LIMIT};
use std::future::IntoFuture;
use std::time::Duration;

/// Extra time after the grace period for aborted streams to flush their last events.
const FLUSH_MARGIN: Duration = Duration::from_secs(5);

pub async fn serve(args: &Args, started: Started) -> anyhow::Result<()> {
    let Started { state, engine } = started;
    let address = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {address}: {e}"))?;
    let local = listener.local_addr()?;
    tracing::info!("serving the OpenAI API on http://{local}/v1 (health: /health, metrics: /metrics)");

    let grace = Duration::from_secs_f64(args.shutdown_timeout);
    let (draining_tx, draining_rx) = tokio::sync::oneshot::channel();
    let engine_for_signal = engine.clone();
    let on_signal = async move {
        let name = wait_for_signal().await;
        tracing::info!("{name}: no new connections; in-flight requests get {grace:?} to finish, then are aborted");
        // The engine drains on its own thread; the HTTP side keeps streaming meanwhile and
        // finishes once every response has ended.
        let drain = tokio::task::spawn_blocking(move || engine_for_signal.shutdown(grace));
        let _ = draining_tx.send(drain);
    };
    let app = router(state, DEFAULT_BODY_LIMIT);
    let server = axum::serve(listener, app).with_graceful_shutdown(on_signal);
    let mut server = std::pin::pin!(server.into_future());
    tokio::select! {
        result = &mut server => result?,
        drain = draining_rx => {
            // The signal arrived: give the connections the grace period plus a margin.
            match tokio::time::timeout(grace + FLUSH_MARGIN, &mut server).await {
                Ok(result) => result?,
                Err(_) => tracing::warn!("connections still open after {:?}; closing them", grace + FLUSH_MARGIN),
            }
            if let Ok(drain) = drain {
                let _ = drain.await;
            }
        }
    }
    // Covers a server that stopped without a signal; a second shutdown call returns at once.
    tokio::task::spawn_blocking(move || engine.shutdown(Duration::ZERO)).await?;
    tracing::info!("stopped");
    Ok(())
}

async fn wait_for_signal() -> &'static str {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
        "SIGINT"
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
        "SIGTERM"
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<&'static str>();
    tokio::select! {
        name = ctrl_c => name,
        name = term => name,
    }
}
