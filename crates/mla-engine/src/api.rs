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
    /// Most prompt tokens one sequence feeds in a step (vLLM's `long_prefill_token_threshold`);
    /// `None`: up to the whole budget. A long prompt then leaves the rest of each step's budget
    /// to the prompts behind it, which start (and reach their first token) without waiting for
    /// it to finish.
    pub long_prefill_token_threshold: Option<usize>,
    /// Requests allowed to wait for admission; the next one is refused with `QueueFull`.
    pub max_queued_requests: usize,
    /// Seeds requests that bring none, so a server started with `--seed` is reproducible.
    pub seed: u64,
    /// Automatic prefix caching: computed blocks are kept by content and reused by prompts
    /// that start the same way.
    pub prefix_caching: bool,
    /// Steps carry decode rows and prompt chunks together instead of taking turns
    /// (on unless `--disable-mixed-chunk`; the scheduler's `mixed_steps`).
    pub mixed_steps: bool,
    /// Speculative decoding with the model's MTP layer: drafts per step, 0 for none
    /// (`--speculative-config`; the backend must have loaded the layer).
    pub mtp_drafts: usize,
    /// Speculative decoding pauses while at least this many sequences run (vLLM's
    /// `disable_by_batch_size`); `None`: never.
    pub spec_disable_batch: Option<usize>,
    /// Draft at a batch size only while drafting measured faster there
    /// (`--speculative-load-rule measured`; docs/speculative-decoding.md, "The measured load
    /// rule").
    pub spec_load_rule: bool,
    /// A step in flight longer than this means a hung device or rank: the engine is declared
    /// dead (`/health` turns 503, requests in flight get the error, the server exits).
    pub step_watchdog: std::time::Duration,
    /// Which attention rank (of which replica) a request goes to; nothing to choose with one.
    pub router: RouterConfig,
}

/// How requests are spread over the attention ranks (`--dp` replicas, DP-attention ranks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterConfig {
    pub policy: RouterPolicy,
    /// The balance rule of `RouterPolicy::Prefix`: the rank holding the longest cached prefix
    /// is passed over for the least-loaded rank when its load (tokens its requests may hold)
    /// exceeds that rank's by more than `balance_abs_tokens` and is more than `balance_rel`
    /// times it. `None`: 32,768 tokens (measured, see the router).
    pub balance_abs_tokens: Option<u64>,
    pub balance_rel: f64,
}

impl Default for RouterConfig {
    /// Prefix-aware, with SGLang's relative gap (its router's `--balance-rel-threshold`).
    fn default() -> Self {
        RouterConfig { policy: RouterPolicy::Prefix, balance_abs_tokens: None, balance_rel: 1.5 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterPolicy {
    /// To the rank whose prefix cache holds the longest start of the prompt, within the
    /// balance rule; the least loaded when none holds more than another. Needs prefix caching.
    Prefix,
    /// To the rank with the least work, whatever the caches hold.
    LeastLoaded,
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
    /// `Some(k)`: report every prompt token's logprob with `k` alternatives
    /// (`EngineEvent::PromptLogprobs`). It costs a logits row per prompt position, and the
    /// prompt is computed in full rather than taken from the prefix cache.
    pub prompt_logprobs: Option<usize>,
    /// Requests with the same owner share one fair share of the batch (the HTTP layer gives
    /// all prompts of one HTTP request one owner); `None`: the request is its own owner.
    pub owner: Option<u64>,
    /// Added to the raw logits of every draw (OpenAI's `logit_bias`), sorted by token, each once.
    pub logit_bias: Vec<(u32, f32)>,
    /// The stop tokens cannot be drawn before this many tokens have been generated.
    pub min_tokens: usize,
    /// Structured output: what each completion may generate.
    pub constraint: Option<ConstraintFactory>,
}

impl GenerateRequest {
    /// One completion of `prompt_tokens` drawn with `sampling`, at most `max_tokens` long, and
    /// every other field neutral: a seed from the engine's generator, no stop tokens, no
    /// logprobs, its own owner, no logit bias, no minimum length, no constraint. Set others
    /// with struct-update syntax, `GenerateRequest { n: 4, ..GenerateRequest::new(..) }`, so
    /// that a new field is defaulted here alone.
    pub fn new(prompt_tokens: Vec<u32>, sampling: SamplingParams, max_tokens: usize) -> Self {
        GenerateRequest {
            prompt_tokens,
            n: 1,
            sampling,
            seed: None,
            max_tokens,
            stop_token_ids: vec![],
            logprobs: None,
            prompt_logprobs: None,
            owner: None,
            logit_bias: vec![],
            min_tokens: 0,
            constraint: None,
        }
    }
}

/// How long one completion's structured-output mask may take to compute. The masks of a step
/// are computed while the device runs its forward pass, and the step cannot sample before they
/// are done, so one grammar's slow mask would hold back every other request's token: past this
/// time the constraint gives up (`TokenConstraint::fill_mask`) and its request fails alone.
/// Ordinary masks take microseconds to a few milliseconds on a 129K vocabulary.
pub const MASK_BUDGET: Duration = Duration::from_millis(50);

/// Restricts what one completion may generate next (structured output). The server builds it
/// from a grammar; the engine asks it for the allowed tokens before every draw and tells it each
/// token drawn. It speaks token ids only: no strings reach the engine.
pub trait TokenConstraint: Send {
    /// Sets bit `t % 32` of `mask[t / 32]` for every token `t` allowed next. `mask` arrives zeroed
    /// with one bit per vocabulary entry; at least one token must be allowed (a finished grammar
    /// allows the end-of-sequence token). The work must end by `deadline` (`MASK_BUDGET` after
    /// it starts). An error (the deadline passed, the grammar allows nothing here, it failed)
    /// rejects this request alone with the message (`EngineEvent::Rejected`); the other
    /// requests of the step go on.
    fn fill_mask(&mut self, mask: &mut [u32], deadline: Instant) -> Result<(), String>;
    /// Records the token drawn. An error (the token breaks the constraint, or following it
    /// failed, e.g. past a grammar limit) rejects the request the same way.
    fn accept(&mut self, token: u32) -> Result<(), String>;
    /// Speculative decoding: goes on as if `token`, a draft the last mask allowed, had been
    /// drawn, so the next `fill_mask` gives the mask after it; `rollback` undoes it. The engine
    /// follows a step's drafts to fill their verify rows' masks, then rolls them back and
    /// `accept`s what the step emits. An error rejects the request as `accept`'s does.
    fn follow(&mut self, token: u32) -> Result<(), String>;
    /// Undoes the last `n` `follow`s. A failure leaves the constraint failed: its next
    /// `fill_mask` says why.
    fn rollback(&mut self, n: usize);
}

/// Makes one `TokenConstraint` per completion of a request (`n` completions diverge).
#[derive(Clone)]
pub struct ConstraintFactory(pub std::sync::Arc<dyn Fn() -> Box<dyn TokenConstraint> + Send + Sync>);

impl std::fmt::Debug for ConstraintFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConstraintFactory")
    }
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

/// One prompt token's log-probability given the prompt before it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptTokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// 1 + the number of tokens the model scored higher (vLLM's rank).
    pub rank: u32,
    /// The most likely tokens there, best first.
    pub top: Vec<(u32, f32)>,
}

/// What the engine streams back for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// The request got its place in the KV cache; `cached_tokens` of its prompt were already
    /// there (prefix caching) and are not computed again. Sent once, before any token.
    Admitted { cached_tokens: usize },
    /// Asked for with `prompt_logprobs`: entry `i` scores prompt token `i + 1` (the first token
    /// has nothing before it). Sent once, before any token.
    PromptLogprobs { entries: Vec<PromptTokenLogprob> },
    /// Completion `index` produced `token`. `finish` is set on its last token.
    Token { index: usize, token: u32, logprobs: Option<TokenLogprobs>, finish: Option<FinishReason> },
    /// Completion `index` ended without a new token: aborted, or ended by the caller
    /// (`RequestStream::finish_choice`, with the caller's reason).
    Finished { index: usize, reason: FinishReason },
    /// The request failed inside the engine; no more events follow.
    Error { message: String },
    /// The request cannot go on by its own doing: its structured-output constraint failed (its
    /// mask outran `MASK_BUDGET`, its grammar outgrew its memory, it allows no token). The
    /// server reports it as the client's error. No more events follow.
    Rejected { message: String },
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
    /// The backend failed for good (a rank died, a collective broke); the server is going down.
    #[error("the engine stopped: {0}")]
    Unavailable(String),
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
