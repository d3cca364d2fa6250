//! One streamed request as vLLM's `async_request_openai_completions` and
//! `async_request_openai_chat_completions` send and time it: TTFT at the first chunk carrying a
//! choice, one ITL gap per later such chunk, latency at the last one; token counts from the
//! closing usage chunk (`stream_options.include_usage`).

use super::client::{Client, Exchange};
use super::dataset::Prompt;
use super::metrics::RequestRecord;
use super::sse::SseParser;
use http_body_util::BodyExt;
use hyper::Method;
use serde_json::{json, Map, Value};
use std::time::Instant;

/// vLLM's `--backend`: which API the prompts go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// `/v1/completions` (vLLM's `openai`; `vllm` is its other name there).
    #[value(alias = "vllm")]
    Openai,
    /// `/v1/chat/completions`, the prompt as one user message.
    OpenaiChat,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Openai => "openai",
            Backend::OpenaiChat => "openai-chat",
        }
    }

    pub fn default_endpoint(self) -> &'static str {
        match self {
            Backend::Openai => "/v1/completions",
            Backend::OpenaiChat => "/v1/chat/completions",
        }
    }

    /// vLLM's check that the endpoint is the backend's API.
    pub fn check_endpoint(self, endpoint: &str) -> anyhow::Result<()> {
        let suffix = match self {
            Backend::Openai => "completions",
            Backend::OpenaiChat => "chat/completions",
        };
        anyhow::ensure!(
            endpoint.ends_with(suffix),
            "--endpoint {endpoint}: the {} backend's endpoint must end with {suffix:?}",
            self.name()
        );
        Ok(())
    }
}

/// What every request of a run shares.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    pub backend: Backend,
    pub endpoint: String,
    /// The model name sent in requests.
    pub model: String,
    pub ignore_eos: bool,
    /// Sampling parameters and `--extra-body`, merged into every body.
    pub extra_body: Map<String, Value>,
}

impl RequestSpec {
    fn body(&self, p: &Prompt) -> anyhow::Result<Value> {
        let mut body = match self.backend {
            Backend::Openai => json!({"model": self.model, "prompt": p.prompt, "max_tokens": p.output_len}),
            Backend::OpenaiChat => {
                let text = p.prompt.as_str().ok_or_else(|| anyhow::anyhow!("the chat backend needs text prompts"))?;
                json!({
                    "model": self.model,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
                    "max_completion_tokens": p.output_len,
                })
            }
        };
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        if self.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        for (k, v) in &self.extra_body {
            body[k] = v.clone();
        }
        Ok(body)
    }
}

/// Sends `p` and times it; `bench_start` dates `start`. `want_ids` asks for the output's token
/// ids (vLLM's `return_tokens_as_token_ids` extension, which mla-serve has too), which the
/// multi-turn dataset puts in the next turn's prompt.
pub async fn send(
    client: &Client,
    spec: &RequestSpec,
    p: &Prompt,
    want_ids: bool,
    request_id: Option<String>,
    bench_start: Instant,
) -> RequestRecord {
    let mut rec = RequestRecord { prompt_tokens: p.prompt_len, ..Default::default() };
    let t0 = Instant::now();
    rec.start = (t0 - bench_start).as_secs_f64();
    let result = stream(client, spec, p, want_ids, request_id, t0, &mut rec).await;
    match result {
        Ok(()) => rec.success = true,
        Err(e) => rec.error = Some(format!("{e:#}")),
    }
    rec
}

async fn stream(
    client: &Client,
    spec: &RequestSpec,
    p: &Prompt,
    want_ids: bool,
    request_id: Option<String>,
    t0: Instant,
    rec: &mut RequestRecord,
) -> anyhow::Result<()> {
    let mut body = spec.body(p)?;
    if want_ids {
        body["logprobs"] = json!(0);
        body["return_tokens_as_token_ids"] = json!(true);
    }
    let extra: Vec<(&str, String)> = request_id.into_iter().map(|id| ("x-request-id", id)).collect();
    let Exchange { response, sender } = client.send(Method::POST, &spec.endpoint, Some(&body), &extra).await?;
    let status = response.status();
    let mut body = response.into_body();
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
            let Some(choice) = v["choices"].as_array().and_then(|c| c.first()) else {
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    usage_out = u["completion_tokens"].as_u64().map(|x| x as usize);
                    if let Some(pt) = u["prompt_tokens"].as_u64() {
                        rec.prompt_tokens = pt as usize;
                    }
                    rec.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as usize;
                }
                continue;
            };
            match last {
                None => rec.ttft = (now - t0).as_secs_f64(),
                Some(prev) => rec.itl.push((now - prev).as_secs_f64()),
            }
            last = Some(now);
            chunks += 1;
            let text = match spec.backend {
                Backend::Openai => &choice["text"],
                Backend::OpenaiChat => &choice["delta"]["content"],
            };
            rec.generated_text.push_str(text.as_str().unwrap_or(""));
            if want_ids {
                for t in choice["logprobs"]["tokens"].as_array().into_iter().flatten() {
                    let id = t.as_str().and_then(|s| s.strip_prefix("token_id:")).and_then(|s| s.parse().ok());
                    rec.output_ids.push(id.ok_or_else(|| anyhow::anyhow!("token {t} is not token_id:N"))?);
                }
            }
        }
    }
    client.done(sender);
    let last = last.ok_or_else(|| anyhow::anyhow!("the stream carried no output"))?;
    rec.latency = (last - t0).as_secs_f64();
    // A usage count of 0 falls back as vLLM's `if not output_len` does.
    rec.output_tokens = usage_out.filter(|&n| n > 0).unwrap_or(chunks);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(backend: Backend) -> RequestSpec {
        let mut extra = Map::new();
        extra.insert("temperature".into(), json!(0.0));
        RequestSpec {
            backend,
            endpoint: backend.default_endpoint().into(),
            model: "m".into(),
            ignore_eos: true,
            extra_body: extra,
        }
    }

    #[test]
    fn bodies_are_vllms() {
        let p = Prompt { prompt: json!("hello"), prompt_len: 1, output_len: 7 };
        let b = spec(Backend::Openai).body(&p).unwrap();
        assert_eq!(
            b,
            json!({"model": "m", "prompt": "hello", "max_tokens": 7, "stream": true,
                   "stream_options": {"include_usage": true}, "ignore_eos": true, "temperature": 0.0})
        );
        let b = spec(Backend::OpenaiChat).body(&p).unwrap();
        assert_eq!(b["messages"], json!([{"role": "user", "content": [{"type": "text", "text": "hello"}]}]));
        assert_eq!((b["max_completion_tokens"].as_u64(), b.get("max_tokens")), (Some(7), None));
        let ids = Prompt { prompt: json!([1, 2]), prompt_len: 2, output_len: 7 };
        assert!(spec(Backend::OpenaiChat).body(&ids).is_err());
    }

    #[test]
    fn endpoints_must_match_the_backend() {
        assert!(Backend::Openai.check_endpoint("/v1/completions").is_ok());
        assert!(Backend::OpenaiChat.check_endpoint("/v1/completions").is_err());
        assert!(Backend::OpenaiChat.check_endpoint("/api/v1/chat/completions").is_ok());
        assert!(Backend::Openai.check_endpoint("/v1/models").is_err());
    }
}
