//! The access line of one request: held while the request runs, written when it is dropped,
//! which is when the response body has ended or been abandoned (client gone), or, when the
//! client left before any response existed, when the request's future was dropped.

use super::record::{AccessRecord, Fields};
use axum::http::{Method, StatusCode, Uri};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Logged for a request whose client left before the response started: nginx's code for it,
/// which log tools already know; nothing was sent.
const CLIENT_CLOSED: u16 = 499;

pub(super) struct PendingLine {
    record: AccessRecord,
    peer: Option<SocketAddr>,
    /// `METHOD path?query`, as the request line has it.
    request: String,
    status: Option<StatusCode>,
    /// The body was read to its end (an atomic: `http_body::Body::is_end_stream` takes `&self`).
    ended: AtomicBool,
    /// At info level; else at debug (`--disable-uvicorn-access-log`, quiet endpoints).
    loud: bool,
}

impl PendingLine {
    pub fn new(record: AccessRecord, peer: Option<SocketAddr>, method: &Method, uri: &Uri, loud: bool) -> Self {
        let target = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
        PendingLine { record, peer, request: format!("{method} {target}"), status: None, ended: false.into(), loud }
    }

    pub fn responded(&mut self, status: StatusCode) {
        self.status = Some(status);
    }

    pub fn ended(&self) {
        self.ended.store(true, Ordering::Relaxed);
    }
}

impl Drop for PendingLine {
    fn drop(&mut self) {
        if !self.loud && !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        let fields = self.record.fields();
        let arrived = self.record.arrived();
        let first_token = fields.generation.as_ref().and_then(|g| g.first_token);
        let line = Line {
            peer: self.peer,
            request: &self.request,
            status: self.status,
            ended: *self.ended.get_mut(),
            latency: arrived.elapsed(),
            ttft: first_token.map(|t| t.saturating_duration_since(arrived)),
            fields,
        }
        .to_string();
        if self.loud {
            tracing::info!("{line}");
        } else {
            tracing::debug!("{line}");
        }
    }
}

/// Everything one line says; `Display` writes it.
struct Line<'a> {
    peer: Option<SocketAddr>,
    request: &'a str,
    status: Option<StatusCode>,
    ended: bool,
    latency: Duration,
    ttft: Option<Duration>,
    fields: Fields,
}

impl std::fmt::Display for Line<'_> {
    /// `access: 127.0.0.1:53312 "POST /v1/chat/completions" 200 prompt_tokens=12
    /// completion_tokens=40 cached_tokens=0 finish=stop latency_ms=812.4 ttft_ms=35.1
    /// stream=true request_id=chatcmpl-...`, then `aborted=true` when the client left first.
    /// Token fields only for requests that reached the engine; the request is quoted with
    /// escapes, so nothing a client sends can forge a second line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let peer = self.peer.map_or("-".to_string(), |p| p.to_string());
        let status = self.status.map_or(CLIENT_CLOSED, |s| s.as_u16());
        write!(f, "access: {peer} {:?} {status}", self.request)?;
        if let Some(g) = &self.fields.generation {
            write!(
                f,
                " prompt_tokens={} completion_tokens={} cached_tokens={} finish={}",
                g.prompt_tokens, g.completion_tokens, g.cached_tokens, g.finish
            )?;
        }
        write!(f, " latency_ms={:.1}", ms(self.latency))?;
        if let Some(t) = self.ttft {
            write!(f, " ttft_ms={:.1}", ms(t))?;
        }
        if let Some(id) = &self.fields.request_id {
            write!(f, " stream={} request_id={id}", self.fields.stream)?;
        }
        if self.status.is_none() || !self.ended {
            write!(f, " aborted=true")?;
        }
        Ok(())
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access_log::record::GenerationOutcome;

    fn line(status: Option<StatusCode>, ended: bool, fields: Fields) -> String {
        Line {
            peer: Some("127.0.0.1:53312".parse().unwrap()),
            request: "POST /v1/chat/completions",
            status,
            ended,
            latency: Duration::from_micros(812_400),
            ttft: fields.generation.as_ref().map(|_| Duration::from_micros(35_100)),
            fields,
        }
        .to_string()
    }

    fn generated(finish: &str) -> Fields {
        Fields {
            request_id: Some("chatcmpl-abc".into()),
            stream: true,
            generation: Some(GenerationOutcome {
                prompt_tokens: 12,
                completion_tokens: 40,
                cached_tokens: 0,
                finish: finish.into(),
                first_token: None,
            }),
        }
    }

    #[test]
    fn a_finished_generation() {
        assert_eq!(
            line(Some(StatusCode::OK), true, generated("stop")),
            "access: 127.0.0.1:53312 \"POST /v1/chat/completions\" 200 prompt_tokens=12 completion_tokens=40 \
             cached_tokens=0 finish=stop latency_ms=812.4 ttft_ms=35.1 stream=true request_id=chatcmpl-abc"
        );
    }

    #[test]
    fn a_stream_the_client_left() {
        let l = line(Some(StatusCode::OK), false, generated("abort"));
        assert!(l.contains(" 200 ") && l.contains("finish=abort") && l.ends_with(" aborted=true"), "{l}");
    }

    #[test]
    fn an_error_and_a_request_abandoned_before_its_response() {
        let l = line(Some(StatusCode::BAD_REQUEST), true, Fields::default());
        assert_eq!(l, "access: 127.0.0.1:53312 \"POST /v1/chat/completions\" 400 latency_ms=812.4");
        let l = line(None, false, Fields::default());
        assert!(l.contains("\" 499 latency_ms=") && l.ends_with(" aborted=true"), "{l}");
    }

    #[test]
    fn the_request_cannot_break_the_line() {
        let l = Line {
            peer: None,
            request: "GET /x\"\n INFO access: forged",
            status: Some(StatusCode::NOT_FOUND),
            ended: true,
            latency: Duration::ZERO,
            ttft: None,
            fields: Fields::default(),
        }
        .to_string();
        assert!(!l.contains('\n') && l.starts_with("access: - \"GET /x\\\"\\n INFO"), "{l}");
    }
}
