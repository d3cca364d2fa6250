//! Serving until a signal, then shutting down in bounded time: stop accepting connections,
//! let in-flight requests finish for `--shutdown-timeout` seconds, abort the rest, exit 0.
//!
//! The same happens, ending in an error (a non-zero exit), when the engine dies: a rank failed
//! or a step outlived its watchdog. Its requests have been answered with the error by then.

use crate::cli::Args;
use crate::startup::Started;
use mla_server::app::{router, HttpOptions};
use mla_server::listener;
use std::time::Duration;

/// Extra time after the grace period for aborted streams to flush their last events.
const FLUSH_MARGIN: Duration = Duration::from_secs(5);

/// Binds the HTTP port (before the model loads; see `main`).
pub fn bind(args: &Args) -> anyhow::Result<std::net::TcpListener> {
    let address = format!("{}:{}", args.host, args.port);
    let listener =
        std::net::TcpListener::bind(&address).map_err(|e| anyhow::anyhow!("cannot listen on {address}: {e}"))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

pub async fn serve(args: &Args, listener: std::net::TcpListener, started: Started) -> anyhow::Result<()> {
    let Started { state, engine } = started;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let local = listener.local_addr()?;
    tracing::info!("serving the OpenAI API on http://{local}/v1 (health: /health, metrics: /metrics)");

    if !args.disable_log_stats {
        tokio::spawn(crate::stats_log::run(engine.clone()));
    }
    let grace = Duration::from_secs_f64(args.shutdown_timeout);
    let (draining_tx, draining_rx) = tokio::sync::oneshot::channel();
    let (died_tx, died_rx) = tokio::sync::oneshot::channel();
    let engine_for_signal = engine.clone();
    let grammars = state.grammars.clone();
    let on_signal = async move {
        tokio::select! {
            name = wait_for_signal() => {
                tracing::info!("{name}: no new connections; in-flight requests get {grace:?} to finish, then are aborted");
            }
            why = wait_for_death(&engine_for_signal) => {
                tracing::error!("the engine stopped ({why}); shutting down, other requests get {grace:?} to finish");
                let _ = died_tx.send(why);
            }
        }
        // Requests still waiting for a grammar compilation could not start any more (the
        // engine takes no new work): they are answered now, and the compilations are left to
        // the process's exit.
        if let Some(g) = &grammars {
            g.close();
        }
        // A second signal while draining means "now": an operator's second Ctrl-C, or an
        // orchestrator that stopped waiting.
        tokio::spawn(async {
            let name = wait_for_signal().await;
            tracing::warn!("{name} again: exiting now without waiting for in-flight requests");
            exit_now(128 + signal_number(name));
        });
        // The engine drains on its own thread; the HTTP side keeps streaming meanwhile and
        // finishes once every response has ended.
        let drain = tokio::task::spawn_blocking(move || engine_for_signal.shutdown(grace));
        let _ = draining_tx.send(drain);
    };
    let body = args.http.body(state.limits.max_model_len);
    let limits = args.http.connections();
    tracing::info!(
        "connections: at most {}, request head within {:?}; bodies: at most {} bytes within {:?}",
        limits.max_connections,
        limits.keep_alive,
        body.max_bytes,
        body.read_timeout
    );
    let cors = args.cors.layer()?;
    if let Some(origins) = &args.cors.allowed_origins {
        tracing::info!("CORS: pages from {origins} may call the API from a browser");
    }
    let open = state.connections.clone();
    let app = router(state, HttpOptions { body, access_log: args.access_log.config(), cors });
    let connections = listener::serve(listener, app, limits, open, on_signal).await;
    // The signal (or the engine's death) came: no new connections. The open ones finish their
    // responses within the grace period plus a margin for aborted streams' last events.
    if tokio::time::timeout(grace + FLUSH_MARGIN, connections.close()).await.is_err() {
        tracing::warn!("connections still open after {:?}; closing them", grace + FLUSH_MARGIN);
    }
    if let Ok(drain) = draining_rx.await {
        let _ = drain.await;
    }
    // Covers a server that stopped without a signal; a second shutdown call returns at once.
    let watched = engine.clone();
    tokio::task::spawn_blocking(move || engine.shutdown(Duration::ZERO)).await?;
    // A dead engine ends the process with an error however the shutdown began: the death watch
    // polls, so a signal may arrive first, and a clean exit would also run the device
    // libraries' exit handlers while a rank may still be stuck in a collective.
    if let Some(why) = died_rx.await.ok().or_else(|| watched.fatal_error()) {
        return Err(EngineDied(why).into());
    }
    tracing::info!("stopped");
    Ok(())
}

/// The engine's backend failed for good; the process should end at once (see `main`).
#[derive(Debug, thiserror::Error)]
#[error("the engine stopped: {0}")]
pub struct EngineDied(pub String);

/// How often the server checks whether the engine died.
const LIVENESS_POLL: Duration = Duration::from_millis(200);

/// Resolves with the reason once the engine can no longer serve.
async fn wait_for_death(engine: &mla_engine::EngineHandle) -> String {
    loop {
        if let Some(why) = engine.fatal_error() {
            return why;
        }
        tokio::time::sleep(LIVENESS_POLL).await;
    }
}

fn signal_number(name: &str) -> i32 {
    if name == "SIGINT" {
        libc::SIGINT
    } else {
        libc::SIGTERM
    }
}

/// Ends the process at once with `code` (128 + the signal, as a shell reports a process killed
/// by it). `_exit` skips exit handlers: a rank may be inside a device call that would make
/// them wait.
pub fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` takes no pointers and never returns; nothing after it runs.
    unsafe { libc::_exit(code) }
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
