//! A scripted OpenAI-compatible server for the `mla-bench serve` tests: `/v1/models` names one
//! model owned by mla-serve, an out-of-vocabulary prompt gets mla-serve's refusal, and every
//! other completion (or chat completion) streams `max_tokens` chunks a few ms apart, then a
//! usage chunk. HTTP/1.1 with keep-alive, optionally over TLS, written by hand so the test sees
//! exactly what the client sends.

#![allow(dead_code)]

use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio_rustls::rustls;

pub const VOCAB: u64 = 50;

/// One request as the server read it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Value,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

#[derive(Clone, Default)]
pub struct Behaviour {
    /// Generation requests from this index on (0 = the first, the client's test request) get a 500.
    pub fail_from: Option<usize>,
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

pub struct Mock {
    pub port: u16,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    /// TCP connections accepted (keep-alive makes it fewer than requests).
    pub connections: Arc<Mutex<usize>>,
    _rt: tokio::runtime::Runtime,
}

impl Mock {
    pub fn start(b: Behaviour) -> Mock {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(vec![]));
        let connections = Arc::new(Mutex::new(0));
        let generations = Arc::new(Mutex::new(0usize));
        let (s, c) = (seen.clone(), connections.clone());
        rt.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                *c.lock().unwrap() += 1;
                let (s, g, b) = (s.clone(), generations.clone(), b.clone());
                tokio::spawn(async move {
                    match &b.tls {
                        Some(cfg) => {
                            if let Ok(tls) = tokio_rustls::TlsAcceptor::from(cfg.clone()).accept(stream).await {
                                serve(tls, s, g, b).await;
                            }
                        }
                        None => serve(stream, s, g, b).await,
                    }
                });
            }
        });
        Mock { port, seen, connections, _rt: rt }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    seen: Arc<Mutex<Vec<Seen>>>,
    generations: Arc<Mutex<usize>>,
    b: Behaviour,
) {
    let mut r = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).await.unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, path) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
        let mut headers = vec![];
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).await.unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.push((k.trim().to_lowercase(), v.trim().to_string()));
            }
        }
        let len: usize = headers.iter().find(|(k, _)| k == "content-length").map_or(0, |(_, v)| v.parse().unwrap());
        let mut body = vec![0; len];
        r.read_exact(&mut body).await.unwrap();
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        seen.lock().unwrap().push(Seen { method: method.clone(), path: path.clone(), headers, body: body.clone() });
        let w = r.get_mut();
        if path == "/v1/models" {
            let v =
                json!({"object": "list", "data": [{"id": "mock-model", "object": "model", "owned_by": "mla-serve"}]});
            send_json(w, "200 OK", &v).await;
            continue;
        }
        if let Some(bad) =
            body["prompt"].as_array().and_then(|ids| ids.iter().find(|t| t.as_u64().is_none_or(|t| t >= VOCAB)))
        {
            let msg = format!("token id {bad} in prompt is outside the vocabulary (0..{VOCAB})");
            send_json(w, "400 Bad Request", &json!({"error": {"message": msg, "type": "invalid_request_error"}})).await;
            continue;
        }
        let k = {
            let mut g = generations.lock().unwrap();
            *g += 1;
            *g - 1
        };
        if b.fail_from.is_some_and(|f| k >= f) {
            send_json(w, "500 Internal Server Error", &json!({"error": {"message": "scripted failure"}})).await;
            continue;
        }
        stream_reply(w, &path, &body).await;
    }
}

async fn send_json<W: AsyncWrite + Unpin>(w: &mut W, status: &str, v: &Value) {
    let body = v.to_string();
    let head = format!("HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len());
    w.write_all(head.as_bytes()).await.unwrap();
    w.write_all(body.as_bytes()).await.unwrap();
    w.flush().await.unwrap();
}

async fn chunk<W: AsyncWrite + Unpin>(w: &mut W, data: &str) {
    let event = format!("data: {data}\n\n");
    w.write_all(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes()).await.unwrap();
    w.flush().await.unwrap();
}

async fn stream_reply<W: AsyncWrite + Unpin>(w: &mut W, path: &str, body: &Value) {
    let chat = path.ends_with("chat/completions");
    let n = body[if chat { "max_completion_tokens" } else { "max_tokens" }].as_u64().unwrap_or(1);
    let prompt_tokens = match body["prompt"].as_array() {
        Some(ids) => ids.len(),
        None => 7,
    };
    w.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    for i in 0..n {
        tokio::time::sleep(Duration::from_millis(2)).await;
        let c = if chat {
            json!({"choices": [{"index": 0, "delta": {"content": format!("t{i} ")}}]})
        } else {
            json!({"choices": [{"index": 0, "text": format!("t{i} ")}]})
        };
        chunk(w, &c.to_string()).await;
    }
    let usage = json!({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n}});
    chunk(w, &usage.to_string()).await;
    chunk(w, "[DONE]").await;
    w.write_all(b"0\r\n\r\n").await.unwrap();
    w.flush().await.unwrap();
}

/// The server's TLS config and the PEM of the CA that signed its certificate. The files in
/// tests/tls are a test CA and a certificate for IP 127.0.0.1 it signed, valid until 2126, made
/// with `openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -days 36500 ...` for the
/// CA and `openssl x509 -req ... -extfile` (subjectAltName=IP:127.0.0.1, serverAuth) for the
/// server: fixed files, so the tests need no certificate generator.
pub fn tls_pair() -> (Arc<rustls::ServerConfig>, String) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tls");
    let cert = CertificateDer::from_pem_file(dir.join("server.pem")).unwrap();
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .unwrap();
    (Arc::new(cfg), std::fs::read_to_string(dir.join("ca.pem")).unwrap())
}
