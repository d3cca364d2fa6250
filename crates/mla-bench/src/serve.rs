//! Load generator against any OpenAI-compatible server (`/v1/completions`, streamed): Poisson
//! arrivals at `request_rate` (all at once when infinite), at most `max_concurrency` requests in
//! flight, one HTTP/1 connection per request. Timings follow `metrics` (vLLM's definitions).

use crate::dataset::Prompt;
use crate::metrics::RequestRecord;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

#[derive(Debug, Clone)]
pub struct Target {
    /// host:port
    pub authority: String,
    /// Path prefix before `/v1/...` (usually empty).
    pub prefix: String,
}

impl Target {
    pub fn parse(url: &str) -> anyhow::Result<Target> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| anyhow::anyhow!("--base-url {url}: only plain http:// URLs are supported"))?;
        let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
        anyhow::ensure!(!authority.is_empty(), "--base-url {url}: no host");
        let authority = if authority.contains(':') { authority.to_string() } else { format!("{authority}:80") };
        let prefix = path.trim_end_matches('/');
        let prefix = prefix.strip_suffix("v1").unwrap_or(prefix).trim_end_matches('/');
        Ok(Target { authority, prefix: if prefix.is_empty() { String::new() } else { format!("/{prefix}") } })
    }
}

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub model: String,
    pub request_rate: f64,
    pub max_concurrency: usize,
    pub ignore_eos: bool,
    pub temperature: f64,
    pub seed: u64,
}

async fn send(
    target: &Target,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<hyper::Response<hyper::body::Incoming>> {
    let stream = TcpStream::connect(&target.authority).await?;
    stream.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let req = Request::builder()
        .method(method)
        .uri(format!("{}{}", target.prefix, path))
        .header("host", &target.authority)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    Ok(sender.send_request(req).await?)
}

/// The first model id `/v1/models` lists.
pub async fn first_model(target: &Target) -> anyhow::Result<String> {
    let resp = send(target, "GET", "/v1/models", None).await?;
    let body = resp.into_body().collect().await?.to_bytes();
    let v: Value = serde_json::from_slice(&body)?;
    v["data"][0]["id"].as_str().map(str::to_string).ok_or_else(|| anyhow::anyhow!("/v1/models lists no model: {v}"))
}

/// Splits a server-sent-event stream into `data:` payloads as bytes arrive.
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    pub fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(chunk);
        let mut out = vec![];
        while let Some(end) = find_event_end(&self.buf) {
            let (event, sep) = end;
            let text = String::from_utf8_lossy(&self.buf[..event]).into_owned();
            self.buf.drain(..event + sep);
            for line in text.lines() {
                if let Some(d) = line.strip_prefix("data:") {
                    out.push(d.trim().to_string());
                }
            }
        }
        out
    }
}

fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(if a.0 < c.0 { a } else { c }),
        (a, c) => a.or(c),
    }
}

async fn one_request(target: &Target, o: &LoadOptions, p: &Prompt, want_ids: bool) -> RequestRecord {
    let mut body = json!({
        "model": o.model,
        "prompt": p.prompt,
        "max_tokens": p.max_tokens,
        "temperature": o.temperature,
        "ignore_eos": o.ignore_eos,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if want_ids {
        // vLLM's extension, which mla-serve has too: logprob tokens read "token_id:N".
        body["logprobs"] = json!(0);
        body["return_tokens_as_token_ids"] = json!(true);
    }
    let mut rec = RequestRecord { prompt_tokens: p.prompt_tokens.unwrap_or(0), ..Default::default() };
    let t0 = Instant::now();
    let result: anyhow::Result<()> = async {
        let resp = send(target, "POST", "/v1/completions", Some(body)).await?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let text = body.collect().await?.to_bytes();
            anyhow::bail!("HTTP {status}: {}", String::from_utf8_lossy(&text));
        }
        let mut sse = SseParser::default();
        let (mut last, mut chunks, mut usage_out) = (None::<Instant>, 0usize, None);
        while let Some(frame) = body.frame().await {
            let frame = frame?;
            let Some(data) = frame.data_ref() else { continue };
            let now = Instant::now();
            for payload in sse.push(data) {
                if payload == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(&payload)?;
                if let Some(e) = v.get("error") {
                    anyhow::bail!("server error in stream: {e}");
                }
                if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                    match last {
                        None => rec.ttft = (now - t0).as_secs_f64(),
                        Some(prev) => rec.itl.push((now - prev).as_secs_f64()),
                    }
                    last = Some(now);
                    chunks += 1;
                    if want_ids {
                        for t in v["choices"][0]["logprobs"]["tokens"].as_array().into_iter().flatten() {
                            let id = t.as_str().and_then(|s| s.strip_prefix("token_id:")).and_then(|s| s.parse().ok());
                            rec.output_ids.push(id.ok_or_else(|| anyhow::anyhow!("token {t} is not token_id:N"))?);
                        }
                    }
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    usage_out = u["completion_tokens"].as_u64().map(|x| x as usize);
                    if let Some(pt) = u["prompt_tokens"].as_u64() {
                        rec.prompt_tokens = pt as usize;
                    }
                    rec.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as usize;
                }
            }
        }
        anyhow::ensure!(last.is_some(), "the stream carried no output");
        rec.latency = (last.unwrap() - t0).as_secs_f64();
        rec.output_tokens = usage_out.unwrap_or(chunks);
        Ok(())
    }
    .await;
    match result {
        Ok(()) => rec.success = true,
        Err(e) => rec.error = Some(format!("{e:#}")),
    }
    rec
}

/// Runs every prompt; returns the records in prompt order and the wall time.
pub async fn run(target: Target, o: LoadOptions, prompts: Vec<Prompt>) -> (Vec<RequestRecord>, Duration) {
    let sem = Arc::new(Semaphore::new(o.max_concurrency.max(1)));
    let (target, o) = (Arc::new(target), Arc::new(o));
    let mut rng = rand::rngs::StdRng::seed_from_u64(o.seed ^ 0x5eed);
    let t0 = Instant::now();
    let mut next = t0;
    let mut tasks = Vec::with_capacity(prompts.len());
    for p in prompts {
        if o.request_rate.is_finite() {
            // Exponential gaps: a Poisson process of `request_rate` per second.
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            next += Duration::from_secs_f64(-u.ln() / o.request_rate);
            tokio::time::sleep_until(next.into()).await;
        }
        let permit = sem.clone().acquire_owned().await.expect("the semaphore is never closed");
        let (target, o) = (target.clone(), o.clone());
        tasks.push(tokio::spawn(async move {
            let r = one_request(&target, &o, &p, false).await;
            drop(permit);
            (r, Instant::now())
        }));
    }
    let mut records = Vec::with_capacity(tasks.len());
    let mut end = t0;
    for t in tasks {
        let (r, done) = t.await.expect("request tasks do not panic");
        end = end.max(done);
        records.push(r);
    }
    (records, end - t0)
}

/// Multi-turn conversations: each holds one permit of `max_concurrency` for all its turns and
/// sends them in order, turn k + 1's prompt being turn k's prompt, its output and the new
/// tokens of turn k + 1 (as a chat client resends the whole history). `turns[c][k]` are the new
/// tokens of turn k of conversation c.
pub async fn run_conversations(
    target: Target,
    o: LoadOptions,
    turns: Vec<Vec<Vec<u32>>>,
    output_len: usize,
) -> (Vec<RequestRecord>, Duration) {
    let sem = Arc::new(Semaphore::new(o.max_concurrency.max(1)));
    let (target, o) = (Arc::new(target), Arc::new(o));
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(turns.len());
    for conv in turns {
        let permit = sem.clone().acquire_owned().await.expect("the semaphore is never closed");
        let (target, o) = (target.clone(), o.clone());
        tasks.push(tokio::spawn(async move {
            let mut history: Vec<u32> = Vec::new();
            let mut records = Vec::with_capacity(conv.len());
            for (k, new) in conv.into_iter().enumerate() {
                history.extend(new);
                let p = Prompt { prompt: json!(history), prompt_tokens: Some(history.len()), max_tokens: output_len };
                let mut r = one_request(&target, &o, &p, true).await;
                r.turn = k;
                let failed = !r.success;
                history.extend(std::mem::take(&mut r.output_ids));
                records.push(r);
                if failed {
                    break;
                }
            }
            drop(permit);
            (records, Instant::now())
        }));
    }
    let mut records = Vec::new();
    let mut end = t0;
    for t in tasks {
        let (r, done) = t.await.expect("conversation tasks do not panic");
        end = end.max(done);
        records.extend(r);
    }
    (records, end - t0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_chunks() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b": 1}\n\ndata: [DONE]\n\n"), vec!["{\"a\": 1}".to_string(), "[DONE]".to_string()]);
        assert_eq!(p.push(b"data: x\r\n\r\n"), vec!["x".to_string()]);
    }

    #[test]
    fn urls_parse_to_authority_and_prefix() {
        let t = Target::parse("http://127.0.0.1:8000").unwrap();
        assert_eq!((t.authority.as_str(), t.prefix.as_str()), ("127.0.0.1:8000", ""));
        let t = Target::parse("http://h/v1/").unwrap();
        assert_eq!((t.authority.as_str(), t.prefix.as_str()), ("h:80", ""));
        let t = Target::parse("http://h:1/api/v1").unwrap();
        assert_eq!(t.prefix, "/api");
        assert!(Target::parse("https://h").is_err());
    }
}
