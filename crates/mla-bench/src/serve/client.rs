//! The HTTP side of the load generator: the server's address, HTTP/1.1 connections (plain or
//! TLS) kept alive and reused between requests as vLLM's aiohttp session does, and the headers
//! every request carries: `Authorization: Bearer $OPENAI_API_KEY` when that is set (vLLM's
//! client reads the same variable) and the `--header` pairs.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

/// Where the server listens: `http[s]://host:port/prefix`, the prefix coming before `/v1/...`.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub https: bool,
    pub host: String,
    pub port: u16,
    pub prefix: String,
}

impl Target {
    /// A base URL as vLLM's `--base-url` takes it; a trailing `/v1` is dropped too, since the
    /// endpoints carry their own.
    pub fn parse(url: &str) -> anyhow::Result<Target> {
        let (https, rest) = if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else {
            anyhow::bail!("--base-url {url}: expected http:// or https://")
        };
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !p.contains(']') => {
                (h, p.parse().map_err(|_| anyhow::anyhow!("--base-url {url}: bad port {p:?}"))?)
            }
            _ => (authority, if https { 443 } else { 80 }),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        anyhow::ensure!(!host.is_empty(), "--base-url {url}: no host");
        let prefix = path.trim_end_matches('/');
        let prefix = prefix.strip_suffix("v1").unwrap_or(prefix).trim_end_matches('/');
        let prefix = if prefix.is_empty() { String::new() } else { format!("/{prefix}") };
        Ok(Target { https, host: host.to_string(), port, prefix })
    }

    /// `--host`/`--port`, as vLLM builds its URL when no `--base-url` is given.
    pub fn from_host_port(host: &str, port: u16) -> Target {
        Target {
            https: false,
            host: host.trim_start_matches('[').trim_end_matches(']').into(),
            port,
            prefix: String::new(),
        }
    }

    /// The `Host` header: host:port, brackets around an IPv6 address.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}://{}{}{path}", if self.https { "https" } else { "http" }, self.authority(), self.prefix)
    }
}

type Sender = SendRequest<Full<Bytes>>;

pub struct Client {
    pub target: Target,
    tls: Option<TlsConnector>,
    headers: Vec<(String, String)>,
    idle: Mutex<Vec<Sender>>,
}

/// A response whose body is being read; `done` hands its connection back for reuse.
pub struct Exchange {
    pub response: Response<hyper::body::Incoming>,
    pub sender: SendRequest<Full<Bytes>>,
}

impl Client {
    /// `headers`: `--header` pairs, added after (so overriding) the API key.
    pub fn new(target: Target, insecure: bool, headers: Vec<(String, String)>) -> anyhow::Result<Arc<Client>> {
        let tls = target.https.then(|| super::tls::client_config(insecure).map(TlsConnector::from)).transpose()?;
        let mut all = vec![];
        if let Some(key) = std::env::var("OPENAI_API_KEY").ok().filter(|k| !k.is_empty()) {
            all.push(("authorization".to_string(), format!("Bearer {key}")));
        }
        all.extend(headers);
        Ok(Arc::new(Client { target, tls, headers: all, idle: Mutex::new(vec![]) }))
    }

    async fn connect(&self) -> anyhow::Result<Sender> {
        let stream = TcpStream::connect((self.target.host.as_str(), self.target.port))
            .await
            .map_err(|e| anyhow::anyhow!("connecting to {}: {e}", self.target.authority()))?;
        stream.set_nodelay(true)?;
        match &self.tls {
            None => handshake(stream).await,
            Some(tls) => {
                let name = ServerName::try_from(self.target.host.clone())?;
                let stream = tls
                    .connect(name, stream)
                    .await
                    .map_err(|e| anyhow::anyhow!("TLS with {}: {e}", self.target.authority()))?;
                handshake(stream).await
            }
        }
    }

    /// An idle kept-alive connection, else a new one.
    async fn checkout(&self) -> anyhow::Result<Sender> {
        loop {
            let Some(mut s) = self.idle.lock().expect("not poisoned").pop() else { break };
            // A connection the server closed meanwhile errs here and is dropped.
            if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(1), s.ready()).await {
                return Ok(s);
            }
        }
        self.connect().await
    }

    /// Sends one request; `extra` headers come last. Call `done` once the body is read.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        extra: &[(&str, String)],
    ) -> anyhow::Result<Exchange> {
        let mut sender = self.checkout().await?;
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.target.prefix))
            .header("host", self.target.authority())
            .header("content-type", "application/json");
        for (k, v) in &self.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        for (k, v) in extra {
            req = req.header(*k, v.as_str());
        }
        let req = req.body(Full::new(Bytes::from(body.map(|b| b.to_string()).unwrap_or_default())))?;
        let response = sender.send_request(req).await.map_err(|e| anyhow::anyhow!("{}: {e}", self.target.url(path)))?;
        Ok(Exchange { response, sender })
    }

    /// Keeps the connection of a fully read exchange for the next request.
    pub fn done(&self, sender: SendRequest<Full<Bytes>>) {
        if !sender.is_closed() {
            self.idle.lock().expect("not poisoned").push(sender);
        }
    }

    /// One whole JSON exchange: the status and the body (Null when it is not JSON).
    pub async fn json(&self, method: Method, path: &str, body: Option<&Value>) -> anyhow::Result<(StatusCode, Value)> {
        let Exchange { response, sender } = self.send(method, path, body, &[]).await?;
        let status = response.status();
        let bytes = response.into_body().collect().await?.to_bytes();
        self.done(sender);
        Ok((status, serde_json::from_slice(&bytes).unwrap_or(Value::Null)))
    }
}

async fn handshake<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(stream: S) -> anyhow::Result<Sender> {
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_to_scheme_host_port_and_prefix() {
        let t = Target::parse("http://127.0.0.1:8000").unwrap();
        assert_eq!(t, Target { https: false, host: "127.0.0.1".into(), port: 8000, prefix: String::new() });
        let t = Target::parse("http://h/v1/").unwrap();
        assert_eq!((t.authority(), t.prefix.as_str()), ("h:80".to_string(), ""));
        let t = Target::parse("https://h:1/api/v1").unwrap();
        assert_eq!((t.https, t.port, t.prefix.as_str()), (true, 1, "/api"));
        assert_eq!(t.url("/v1/models"), "https://h:1/api/v1/models");
        assert_eq!(Target::parse("https://example.com").unwrap().port, 443);
        let t = Target::parse("http://[::1]:9000").unwrap();
        assert_eq!((t.host.as_str(), t.authority()), ("::1", "[::1]:9000".to_string()));
        assert!(Target::parse("ftp://h").is_err() && Target::parse("http://:80").is_err());
        assert_eq!(Target::from_host_port("127.0.0.1", 8000), Target::parse("http://127.0.0.1:8000").unwrap());
    }
}
