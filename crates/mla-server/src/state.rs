//! What every handler shares: the engine handle, the model's limits and defaults, the text
//! pipeline and the API key.

use crate::error::ApiError;
use crate::generate::{Generation, LogprobOptions, StopOptions, Submitted};
use crate::generation_config::GenerationDefaults;
use crate::listener::OpenConnections;
use crate::metrics::MetricsConfig;
use crate::parsers::ParserConfig;
use crate::stop::StopMatcher;
use crate::structured::Grammars;
use crate::text::TextPipeline;
use crate::validate::{ModelLimits, ValidatedParams};
use mla_engine::{EngineHandle, GenerateRequest};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub struct AppState {
    pub engine: EngineHandle,
    /// The model name responses and metrics carry.
    pub model_name: String,
    /// Other names requests may use for it (`--served-model-name A B ...`).
    pub model_aliases: Vec<String>,
    /// What the model was loaded from (`--model`), the model card's `root`.
    pub model_root: String,
    pub limits: ModelLimits,
    pub defaults: GenerationDefaults,
    pub text: Arc<TextPipeline>,
    /// `--reasoning-parser`, `--tool-call-parser`, `--enable-auto-tool-choice`.
    pub parsers: ParserConfig,
    pub api_key: Option<String>,
    /// Unix time the server started (`created` of the model card).
    pub started: u64,
    /// The structured-output grammar compiler for this model's vocabulary (built once at
    /// startup); `None` if the model cannot have one (no end-of-sequence token).
    pub grammars: Option<Arc<Grammars>>,
    /// The `/metrics` prefix and cache description.
    pub metrics: MetricsConfig,
    /// `--enable-force-include-usage`: every stream reports the usage on every chunk.
    pub force_include_usage: bool,
    /// `--return-tokens-as-token-ids`: the default of the request field.
    pub return_tokens_as_token_ids: bool,
    /// The HTTP connections the listener holds open (`listener::serve` counts them).
    pub connections: OpenConnections,
}

impl AppState {
    /// `model` absent means the served model (friendlier for curl); any other name is a 404.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.model_name && !self.model_aliases.iter().any(|a| a == m) => {
                Err(ApiError::ModelNotFound { requested: m.to_string(), served: self.model_name.clone() })
            }
            _ => Ok(()),
        }
    }

    /// Submits one engine request per prompt. If one is refused (queue full, too long), the
    /// ones already submitted are dropped, which aborts them.
    pub fn start_generation(
        &self,
        mut requests: Vec<GenerateRequest>,
        params: &ValidatedParams,
        stop: StopMatcher,
    ) -> Result<Generation, ApiError> {
        self.check_batch_shape(requests.len(), params.n)?;
        if requests.len() > 1 {
            // The prompts of one HTTP request share one fair share of the batch: a request with
            // many prompts must not crowd out one with a single prompt.
            let owner = NEXT_OWNER.fetch_add(1, Ordering::Relaxed);
            for r in &mut requests {
                r.owner = Some(owner);
            }
        }
        let mut submitted = Vec::with_capacity(requests.len());
        for req in requests {
            let (prompt_len, n, stop_token_ids) = (req.prompt_tokens.len(), req.n, req.stop_token_ids.clone());
            let stream = self.engine.submit(req)?;
            submitted.push(Submitted { stream, prompt_len, n, stop_token_ids });
        }
        let text = self.text.clone();
        let (skip_special, include_stop, min_tokens) =
            (params.skip_special_tokens, params.include_stop_str, params.min_tokens);
        Ok(Generation::new(
            submitted,
            move || text.choice_text(stop.clone(), skip_special, include_stop, min_tokens),
            LogprobOptions { enabled: params.logprobs.is_some(), tokens_as_ids: params.tokens_as_ids },
            StopOptions { requested_ids: params.stop_token_ids.clone(), include_stop },
            self.text.clone(),
        ))
    }
}

impl AppState {
    /// The server's defaults of request fields: `--return-tokens-as-token-ids`.
    pub fn fill_defaults(&self, w: &mut crate::protocol::common::SamplingWire) {
        w.return_tokens_as_token_ids.get_or_insert(self.return_tokens_as_token_ids);
    }

    /// `--enable-force-include-usage`: a stream reports the usage on every chunk and at its end
    /// whatever `stream_options` said, as vLLM's flag does.
    pub fn force_usage(&self, params: &mut ValidatedParams) {
        if self.force_include_usage && params.stream {
            params.include_usage = true;
            params.continuous_usage = true;
        }
    }
}

/// Owner ids for multi-prompt requests (`GenerateRequest::owner`), unique in this process.
static NEXT_OWNER: AtomicU64 = AtomicU64::new(0);

impl AppState {
    /// Refuses a request whose prompts could never be served together, before any of them is
    /// tokenized: `prompts` is how many it has, each asking for `n` completions.
    pub fn check_batch_shape(&self, prompts: usize, n: usize) -> Result<(), ApiError> {
        // More prompts than the queue can ever hold would be refused with 503 on every retry:
        // that is the request's fault, so 400 naming the limit.
        let limit = self.engine.config().max_queued_requests;
        if prompts > limit {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "{prompts} prompts in one request, but the server queues at most {limit} requests (--max-queued-requests); send fewer prompts per request"
                ),
            ));
        }
        // Every prompt times n is a sequence; a request needing more than one batch holds would
        // take the whole batch from everybody else for as long as it runs.
        let sequences = prompts.saturating_mul(n);
        let max_seqs = self.engine.config().max_num_seqs;
        if sequences > max_seqs {
            return Err(ApiError::invalid(
                "n",
                format!(
                    "{prompts} prompts x n = {sequences} sequences in one request, but a batch holds at most {max_seqs} (--max-num-seqs); send fewer prompts or a smaller n"
                ),
            ));
        }
        Ok(())
    }
}

/// The request's stop strings compiled for matching (`stop::StopAutomaton`): up to 64K states,
/// so handlers build it inside `blocking`, next to the tokenization.
pub fn stop_matcher(stops: Vec<String>) -> Result<StopMatcher, ApiError> {
    StopMatcher::new(stops).map_err(|e| ApiError::invalid("stop", e.to_string()))
}

/// Runs CPU-heavy text work (template rendering, tokenization) off the async runtime.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::Internal(format!("tokenizer task failed: {e}")))?
}
