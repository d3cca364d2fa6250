//! The engine's public interface: what the server submits and what it gets back.
//! Plain data only: token ids, sampling parameters, events. No blocks, no devices, no strings
//! other than error messages.

use mla_core::SamplingParams;
use std::time::{Duration, Instant};

/// Limits the engine enforces; the server validates against the same numbers.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Longest sequence (prompt + output) accepted.
    pub max_model_len: usize,
    /// Most sequences in one running batch.
    pub max_num_seqs: usize,
    /// Token budget of one prefill step (prompt chunks are cut to fit).
    pub max_num_batched_tokens: usize,
    /// Requests allowed to wait for admission; the next one is refused with `QueueFull`.
    pub max_queued_requests: usize,
    /// Seeds requests that bring none, so a server started with `--seed` is reproducible.
    pub seed: u64,
}

/// A validated generation request in token space.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_tokens: Vec<u32>,
    /// Number of independent completions; they share the prompt's cache blocks.
    pub n: usize,
    pub sampling: SamplingParams,
    /// Per-request seed; `None` draws one from the engine's generator.
    pub seed: Option<u64>,
    /// Most tokens to generate per completion (already clamped to the context by the caller).
    pub max_tokens: usize,
    /// Tokens that end a completion (EOS ids unless `ignore_eos`, plus `stop_token_ids`); the stop
    /// token itself is reported with the final event but not counted as text by callers that skip it.
    pub stop_token_ids: Vec<u32>,
    /// `Some(k)`: report each sampled token's logprob and `k` alternatives.
    pub logprobs: Option<usize>,
}

/// Why a completion ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A stop token was sampled, or the caller stopped it (stop string).
    Stop,
    /// `max_tokens` or the context limit was reached.
    Length,
    /// Aborted (client gone, shutdown).
    Abort,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What the engine streams back for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Completion `index` produced `token`. `finish` is set on its last token.
    Token { index: usize, token: u32, logprobs: Option<TokenLogprobs>, finish: Option<FinishReason> },
    /// Completion `index` ended without a new token: aborted, or ended by the caller
    /// (`RequestStream::finish_choice`, with the caller's reason).
    Finished { index: usize, reason: FinishReason },
    /// The request failed inside the engine; no more events follow.
    Error { message: String },
}

/// Refusals at submission; the server maps them to HTTP statuses.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum SubmitError {
    #[error("the request queue is full ({limit} requests waiting); retry later")]
    QueueFull { limit: usize },
    #[error("this model's maximum context length is {limit} tokens, but the request needs {needed} tokens ({prompt} in the prompt)")]
    TooLong { prompt: usize, needed: usize, limit: usize },
    #[error("the prompt needs {blocks} KV cache blocks but the cache only has {capacity}")]
    ExceedsCache { blocks: usize, capacity: usize },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// Timestamps the engine records per request, reported when it finishes.
#[derive(Debug, Clone, Copy)]
pub struct RequestTimings {
    pub arrived: Instant,
    pub first_scheduled: Option<Instant>,
    pub first_token: Option<Instant>,
    pub finished: Option<Instant>,
}

impl RequestTimings {
    pub fn queue_time(&self) -> Option<Duration> {
        self.first_scheduled.map(|t| t - self.arrived)
    }
}

/// Prometheus-style histogram: `counts[i]` observations fell at or below `bounds[i]` and above
/// `bounds[i-1]`; the last count is for values above every bound (+Inf bucket minus the rest).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Histogram {
    pub bounds: Vec<f64>,
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn with_bounds(bounds: &[f64]) -> Self {
        Histogram { bounds: bounds.to_vec(), counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    pub fn observe(&mut self, value: f64) {
        let i = self.bounds.iter().position(|&b| value <= b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += value;
        self.count += 1;
    }
}

/// A consistent snapshot of the engine's counters, for `/metrics` and the startup log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    /// Fraction of KV cache blocks in use, 0..=1.
    pub kv_usage: f64,
    pub kv_capacity_tokens: usize,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Finished completions by the reason the engine ended them: stop (stop token, or the caller's
    /// `finish_choice(.., Stop)` for a stop string), length, abort (aborted, client gone, failed,
    /// or refused at shutdown).
    pub finished_stop: u64,
    pub finished_length: u64,
    pub finished_abort: u64,
    pub preemptions_total: u64,
    /// Seconds.
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_latency: Histogram,
    pub queue_time: Histogram,
}
