//! Helpers shared by the mla-server tests: the demo model's files and tokenizer, transformers'
//! recorded template fixtures, and, for the HTTP-layer tests, a router over the real engine with
//! a scripted backend. Every completion of that backend emits the same token script (the demo
//! tokenizer's encoding of a known text), so responses can be compared with text written by
//! hand; its logprobs are fixed numbers, also known in advance.

#![allow(dead_code)]

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use mla_core::step::plan::{LogitsRequest, SeqResult, SeqStep, StepOutput};
use mla_core::{Backend, CacheLayout, ModelConfig, PendingStep, SampledToken, StepPlan};
use mla_engine::{Engine, EngineConfig, EngineHandle};
use mla_server::access_log::AccessLogConfig;
use mla_server::app::{router, HttpOptions};
use mla_server::extract::BodyLimits;
use mla_server::generation_config::GenerationDefaults;
use mla_server::state::AppState;
use mla_server::structured::Grammars;
use mla_server::text::TextPipeline;
use mla_server::tokenizer::TextTokenizer;
use mla_server::validate::ModelLimits;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower::ServiceExt;

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The bundled demo model: config, generation config, tokenizer.
pub fn demo_dir() -> PathBuf {
    workspace_root().join("assets/demo")
}

/// transformers' recorded chat-template renderings and tokenizer outputs.
pub fn template_fixtures_dir() -> PathBuf {
    workspace_root().join("tests/fixtures/templates")
}

pub fn demo_tokenizer() -> TextTokenizer {
    TextTokenizer::from_dir(&demo_dir()).unwrap()
}

pub fn read_json(path: impl AsRef<Path>) -> serde_json::Value {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

// The HTTP layer over a scripted backend.

/// What every completion of the scripted backend says, as demo-tokenizer tokens.
pub const SCRIPT_TEXT: &str = "Hello there. STOP here and more text after it";
pub const MAX_MODEL_LEN: usize = 256;

/// Emits `script[k]` as the k-th token of every sequence, whatever the prompt (`sibling_script`
/// instead for completions other than the first, when set).
pub struct ScriptBackend {
    model: ModelConfig,
    script: Vec<u32>,
    sibling_script: Option<Vec<u32>>,
    drawn: HashMap<u64, usize>,
    delay: Duration,
    /// Steps fail once a sequence has drawn this many tokens (engine error mid-stream).
    fail_after: Option<usize>,
    pending: PendingStep,
}

impl Backend for ScriptBackend {
    fn device_name(&self) -> String {
        "script".into()
    }
    fn model_config(&self) -> &ModelConfig {
        &self.model
    }
    fn cache_layouts(&self) -> Vec<CacheLayout> {
        vec![CacheLayout { block_size: 16, num_blocks: 64 }]
    }

    fn step_limits(&self) -> mla_core::StepLimits {
        mla_core::StepLimits::unlimited()
    }
    fn start_step(&mut self, plans: &Arc<Vec<StepPlan>>) {
        self.pending.set(plans);
    }
    fn finish_step(&mut self) -> anyhow::Result<Vec<StepOutput>> {
        let plans = self.pending.take()?;
        Ok(vec![self.run(&plans[0])?])
    }
}

impl ScriptBackend {
    fn run(&mut self, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        std::thread::sleep(self.delay);
        if let Some(limit) = self.fail_after {
            if plan.seqs.iter().any(|s| self.drawn.get(&s.seq_id).copied().unwrap_or(0) >= limit) {
                anyhow::bail!("scripted device failure");
            }
        }
        let mut out = StepOutput::default();
        for s in &plan.seqs {
            let sampled = s.sample.as_ref().map(|req| {
                let k = self.drawn.entry(s.seq_id).or_default();
                // Sequence ids are `request << 16 | (completion + 1)`.
                let script = match &self.sibling_script {
                    Some(other) if s.seq_id & 0xFFFF > 1 => other,
                    _ => &self.script,
                };
                let token = script[*k % script.len()];
                *k += 1;
                let top = [(token, -0.5f32), ((token + 1) % 512, -1.5)];
                SampledToken {
                    token,
                    logprob: if req.top_logprobs.is_some() { -0.5 } else { 0.0 },
                    top_logprobs: top.iter().take(req.top_logprobs.unwrap_or(0)).copied().collect(),
                }
            });
            let (logits, scores) = match s.logits {
                LogitsRequest::Scored { top, after } => {
                    (vec![], mla_core::sampling::score_rows(&self.logits(s), &s.tokens, top, after))
                }
                _ => (self.logits(s), vec![]),
            };
            out.seqs.push(SeqResult {
                scores,
                seq_id: s.seq_id,
                logits,
                sampled,
                extra_tokens: vec![],
                drafts: vec![],
            });
        }
        Ok(out)
    }

    /// The rows `s.logits` asks for (prompt logprobs score every fed position): made up, but a
    /// function of the position and its token, so that every prompt scores differently and
    /// every sequence feeding the same prompt gets the same rows.
    fn logits(&self, s: &SeqStep) -> Vec<Vec<f32>> {
        let mut fed = s.tokens.iter().enumerate().map(|(i, &t)| (s.context_len + i, t as usize));
        let rows: Vec<(usize, usize)> = match s.logits {
            LogitsRequest::None => vec![],
            LogitsRequest::Last => fed.next_back().into_iter().collect(),
            LogitsRequest::All | LogitsRequest::Scored { .. } => fed.collect(),
        };
        let vocab = self.model.vocab_size;
        rows.iter().map(|&(p, t)| (0..vocab).map(|v| ((v * 7 + t * 13 + p * 3) % 61) as f32 / 8.0).collect()).collect()
    }
}

pub struct TestServer {
    pub app: Router,
    pub engine: EngineHandle,
    pub script: Vec<u32>,
}

pub struct Options {
    pub script: Vec<u32>,
    /// What completions other than the first emit; `None`: the same `script`.
    pub sibling_script: Option<Vec<u32>>,
    pub api_key: Option<String>,
    pub body_limit: usize,
    pub body_read_timeout: Duration,
    pub max_queued: usize,
    pub delay: Duration,
    pub max_num_seqs: usize,
    pub fail_after: Option<usize>,
    pub parsers: mla_server::parsers::ParserConfig,
}

impl Default for Options {
    fn default() -> Self {
        let script = demo_tokenizer().encode(SCRIPT_TEXT, false).unwrap();
        Options {
            script,
            sibling_script: None,
            api_key: None,
            body_limit: 1 << 20,
            body_read_timeout: Duration::from_secs(30),
            max_queued: 64,
            delay: Duration::ZERO,
            max_num_seqs: 16,
            fail_after: None,
            parsers: Default::default(),
        }
    }
}

pub fn server(opts: Options) -> TestServer {
    let mut model = ModelConfig::from_file(&demo_dir().join("config.json")).unwrap();
    model.max_position_embeddings = MAX_MODEL_LEN;
    let backend = ScriptBackend {
        model: model.clone(),
        script: opts.script.clone(),
        sibling_script: opts.sibling_script.clone(),
        drawn: HashMap::new(),
        delay: opts.delay,
        fail_after: opts.fail_after,
        pending: PendingStep::default(),
    };
    let cfg = EngineConfig {
        spec_load_rule: false,
        long_prefill_token_threshold: None,
        max_model_len: MAX_MODEL_LEN,
        max_num_seqs: opts.max_num_seqs,
        max_num_batched_tokens: 512,
        max_queued_requests: opts.max_queued,
        seed: 0,
        prefix_caching: true,
        mixed_steps: false,
        mtp_drafts: 0,
        spec_disable_batch: None,
        step_watchdog: std::time::Duration::from_secs(300),
        router: mla_engine::RouterConfig::default(),
    };
    let engine = Engine::start(Box::new(backend), cfg).unwrap();
    let text = Arc::new(TextPipeline::new(demo_tokenizer(), None).unwrap());
    let state = AppState {
        engine: engine.clone(),
        model_name: "demo".into(),
        model_aliases: vec![],
        model_root: "demo".into(),
        limits: ModelLimits {
            max_model_len: MAX_MODEL_LEN,
            vocab_size: 512,
            eos_token_ids: vec![1],
            default_max_new_tokens: None,
            max_logprobs: mla_server::validate::MAX_LOGPROBS,
        },
        defaults: GenerationDefaults::default(),
        text: text.clone(),
        parsers: opts.parsers,
        api_key: opts.api_key,
        started: 0,
        grammars: Some(Arc::new(Grammars::new(text, 512, &[1]).unwrap())),
        metrics: Default::default(),
        force_include_usage: false,
        return_tokens_as_token_ids: false,
        connections: Default::default(),
    };
    let body = BodyLimits { max_bytes: opts.body_limit, read_timeout: opts.body_read_timeout };
    let http = HttpOptions { body, access_log: AccessLogConfig::default(), cors: None };
    TestServer { app: router(Arc::new(state), http), engine, script: opts.script }
}

pub struct Reply {
    pub status: StatusCode,
    pub content_type: String,
    pub retry_after: Option<String>,
    pub text: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("{e}: {}", self.text))
    }

    /// The `data:` payloads of an SSE body, checking the framing on the way.
    pub fn events(&self) -> Vec<String> {
        assert!(self.text.ends_with("\n\n"), "{:?}", self.text);
        self.text
            .split_terminator("\n\n")
            .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data event: {e:?}")).to_string())
            .collect()
    }
}

impl TestServer {
    pub async fn call(&self, method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)]) -> Reply {
        let mut req = Request::builder().method(method).uri(path);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(body.map(|b| Body::from(b.to_string())).unwrap_or_else(Body::empty)).unwrap();
        let resp = self.app.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let header = |name: &str| resp.headers().get(name).map(|v| v.to_str().unwrap().to_string());
        let (content_type, retry_after) = (header("content-type").unwrap_or_default(), header("retry-after"));
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        Reply { status, content_type, retry_after, text: String::from_utf8(bytes.to_vec()).unwrap() }
    }

    pub async fn post(&self, path: &str, body: Value) -> Reply {
        self.call("POST", path, Some(&body.to_string()), &[("content-type", "application/json")]).await
    }

    /// The script's text after `k` tokens, decoded independently of the server.
    pub fn script_text(&self, k: usize) -> String {
        demo_tokenizer().decode(&self.script[..k], true).unwrap()
    }
}

/// Waits until nothing runs, waits or holds cache blocks: every request has been counted.
pub async fn wait_idle(s: &TestServer) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = s.engine.stats();
        if st.running + st.waiting == 0 && st.kv_usage == 0.0 {
            return;
        }
        assert!(Instant::now() < deadline, "{st:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A chat request from the user saying `content`, with the fields of `extra` added.
pub fn chat(content: &str, extra: Value) -> Value {
    let mut body = serde_json::json!({"model": "demo", "messages": [{"role": "user", "content": content}]});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}
