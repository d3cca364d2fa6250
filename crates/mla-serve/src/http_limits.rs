//! The flags that bound what one client can hold: connections, how long a connection may sit
//! idle or trickle its request, and how big a request body may be. Each limit keeps a careless
//! or hostile client from degrading the server for the others (file descriptors, tasks, memory).

use clap::Args as ClapArgs;
use mla_server::extract::BodyLimits;
use mla_server::listener::ConnectionLimits;
use std::time::Duration;

#[derive(Debug, Clone, ClapArgs)]
pub struct HttpLimitArgs {
    /// Connections served at once; one more is answered 503 (with Retry-After) and closed. It
    /// is lowered, with a warning, to what the process's file-descriptor limit leaves room for.
    #[arg(long, default_value_t = 4096, value_name = "N")]
    pub max_connections: usize,

    /// Seconds a connection may take to send a complete request head once it can send one
    /// (after opening, or after the previous response): closes idle keep-alive connections and
    /// slow-header ones alike. uvicorn's (and so vLLM's) name; the default is above the 5 s
    /// after which httpx (the openai SDK) drops pooled connections, so a client never reuses one
    /// the server is closing at that moment.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub timeout_keep_alive: f64,

    /// Seconds the whole request body may take to arrive; a slower one gets 408.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub body_read_timeout: f64,

    /// Largest request body in bytes (413 above it, refused from Content-Length before it is
    /// read). Default: 32 bytes per token of --max-model-len, at least 1 MiB: room for any
    /// prompt that fits the context as text or token ids.
    #[arg(long, value_name = "BYTES")]
    pub max_request_body_bytes: Option<usize>,
}

/// Bytes of request body allowed per context token by default: a token id in JSON takes at most
/// 8 bytes with its separator, and text averages 3 to 4 bytes per token (12 for CJK escaped as
/// `\uXXXX`).
const BODY_BYTES_PER_TOKEN: usize = 32;
const MIN_BODY_BYTES: usize = 1 << 20;
/// Descriptors kept back from connections for everything else the process opens: checkpoint
/// shards, NCCL and CUDA, logs, the rendezvous.
const RESERVED_FDS: u64 = 256;

impl HttpLimitArgs {
    pub fn check(&self) -> anyhow::Result<()> {
        if self.max_connections == 0 {
            anyhow::bail!("--max-connections must be at least 1");
        }
        for (flag, v) in
            [("--timeout-keep-alive", self.timeout_keep_alive), ("--body-read-timeout", self.body_read_timeout)]
        {
            if !(v.is_finite() && v > 0.0) {
                anyhow::bail!("{flag} must be a positive number of seconds, got {v}");
            }
        }
        if self.max_request_body_bytes == Some(0) {
            anyhow::bail!("--max-request-body-bytes must be at least 1");
        }
        Ok(())
    }

    pub fn body(&self, max_model_len: usize) -> BodyLimits {
        let derived = max_model_len.saturating_mul(BODY_BYTES_PER_TOKEN).max(MIN_BODY_BYTES);
        BodyLimits {
            max_bytes: self.max_request_body_bytes.unwrap_or(derived),
            read_timeout: Duration::from_secs_f64(self.body_read_timeout),
        }
    }

    /// The connection limits, with `--max-connections` lowered to what the descriptor limit
    /// (raised to its hard limit first) leaves room for.
    pub fn connections(&self) -> ConnectionLimits {
        let fds = mla_core::runtime::fd_limit::raise();
        let room = fds.map(|n| n.saturating_sub(RESERVED_FDS).max(1) as usize);
        let max_connections = match room {
            Some(room) if room < self.max_connections => {
                tracing::warn!(
                    "--max-connections {} lowered to {room}: the open-file limit is {}; raise it (ulimit -n) to serve more",
                    self.max_connections,
                    fds.unwrap_or(0)
                );
                room
            }
            _ => self.max_connections,
        };
        ConnectionLimits { max_connections, keep_alive: Duration::from_secs_f64(self.timeout_keep_alive) }
    }
}
