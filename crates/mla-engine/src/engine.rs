//! `Engine::start` and the `EngineHandle` the server holds: submission checks, statistics and
//! shutdown. The engine thread itself lives in `worker`.

use crate::api::{EngineConfig, EngineEvent, EngineStats, FinishReason, GenerateRequest, SubmitError};
use crate::metrics::Metrics;
use crate::scheduler::blocks_to_admit;
use crate::sequence::MAX_COMPLETIONS;
use anyhow::{bail, Context};
use mla_core::{Backend, CacheLayout, ModelConfig};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

mod backend_call;
mod worker;

/// What the handle tells the engine thread.
#[derive(Debug)]
pub(crate) enum Command {
    Submit {
        id: u64,
        req: GenerateRequest,
        events: UnboundedSender<EngineEvent>,
        arrived: Instant,
    },
    Abort(u64),
    /// End one completion of a request (the caller found a stop string), keeping the others.
    FinishChoice {
        id: u64,
        index: usize,
        reason: FinishReason,
    },
    Shutdown {
        deadline: Instant,
    },
}

/// Starts engines; see `Engine::start`.
pub struct Engine;

impl Engine {
    /// Checks `cfg` against the backend and spawns the engine thread, which owns the backend.
    pub fn start(backend: Box<dyn Backend>, cfg: EngineConfig) -> anyhow::Result<EngineHandle> {
        let model = backend.model_config().clone();
        let layout = backend.cache_layout();
        check_config(&cfg, &model, layout)?;
        let (commands, inbox) = std::sync::mpsc::channel();
        let metrics = Metrics::new(layout);
        let queued = Arc::new(AtomicUsize::new(0));
        let worker = worker::Worker::new(backend, cfg.clone(), inbox, metrics.clone(), queued.clone());
        let thread = std::thread::Builder::new()
            .name("mla-engine".into())
            .spawn(move || worker.run())
            .context("spawning the engine thread")?;
        tracing::info!(
            blocks = layout.num_blocks,
            block_size = layout.block_size,
            max_num_seqs = cfg.max_num_seqs,
            "engine started"
        );
        let shared = Shared {
            cfg,
            layout,
            model,
            commands,
            metrics,
            queued,
            next_id: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            thread: Mutex::new(Some(thread)),
        };
        Ok(EngineHandle { shared: Arc::new(shared) })
    }
}

fn check_config(cfg: &EngineConfig, model: &ModelConfig, layout: CacheLayout) -> anyhow::Result<()> {
    for (name, v) in [
        ("max_model_len", cfg.max_model_len),
        ("max_num_seqs", cfg.max_num_seqs),
        ("max_num_batched_tokens", cfg.max_num_batched_tokens),
        ("max_queued_requests", cfg.max_queued_requests),
        ("cache block_size", layout.block_size),
        ("cache num_blocks", layout.num_blocks),
    ] {
        if v == 0 {
            bail!("engine config: {name} must be at least 1");
        }
    }
    if cfg.max_model_len > model.max_position_embeddings {
        bail!(
            "engine config: max_model_len {} exceeds the model's max_position_embeddings {}",
            cfg.max_model_len,
            model.max_position_embeddings
        );
    }
    // A sequence that could outgrow the whole cache would preempt itself forever.
    if layout.capacity_tokens() < cfg.max_model_len {
        bail!(
            "engine config: the KV cache holds {} tokens, fewer than max_model_len {}; lower max_model_len or give the cache more memory",
            layout.capacity_tokens(),
            cfg.max_model_len
        );
    }
    Ok(())
}

struct Shared {
    cfg: EngineConfig,
    layout: CacheLayout,
    model: ModelConfig,
    commands: Sender<Command>,
    metrics: Metrics,
    /// Requests submitted and not yet scheduled (the `max_queued_requests` count).
    queued: Arc<AtomicUsize>,
    next_id: AtomicU64,
    shutting_down: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Cheap to clone; every clone drives the same engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
}

/// The events of one request. Dropping it (or just `events`) closes the channel, which the
/// engine notices at its next step and treats as an abort, freeing the request's blocks; there is
/// deliberately no `Drop` impl, so callers may move `events` out.
#[derive(Debug)]
pub struct RequestStream {
    pub id: u64,
    pub events: UnboundedReceiver<EngineEvent>,
    /// The request's `n`, to check `finish_choice` indices.
    n: usize,
    commands: Sender<Command>,
}

impl RequestStream {
    /// Aborts the request; unfinished completions report `Finished { reason: Abort }`.
    pub fn abort(&self) {
        // A closed channel means the engine is gone, and the request with it.
        let _ = self.commands.send(Command::Abort(self.id));
    }

    /// Ends completion `index` alone, for a reason only the caller can see (a stop string in
    /// the text): before the next step the engine frees its blocks, wherever it is (running,
    /// waiting or preempted), sends `Finished { index, reason }` and counts it under `reason`.
    /// Tokens of it already in flight may still arrive before that event. The request's other
    /// completions go on exactly as if nothing happened. A completion that has already finished
    /// is left alone (no event, no count), so racing with its own end is harmless.
    ///
    /// Panics if `index` is not below the request's `n` (a caller bug).
    pub fn finish_choice(&self, index: usize, reason: FinishReason) {
        assert!(index < self.n, "request {} has no completion {index} (n = {})", self.id, self.n);
        let _ = self.commands.send(Command::FinishChoice { id: self.id, index, reason });
    }
}

impl EngineHandle {
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, SubmitError> {
        let s = &self.shared;
        if s.shutting_down.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        validate(&req, &s.cfg, s.layout, s.model.vocab_size)?;
        let limit = s.cfg.max_queued_requests;
        s.queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| (q < limit).then_some(q + 1))
            .map_err(|_| SubmitError::QueueFull { limit })?;
        let id = s.next_id.fetch_add(1, Ordering::Relaxed);
        let n = req.n;
        let (tx, events) = unbounded_channel();
        let cmd = Command::Submit { id, req, events: tx, arrived: Instant::now() };
        if s.commands.send(cmd).is_err() {
            s.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::ShuttingDown);
        }
        Ok(RequestStream { id, events, n, commands: s.commands.clone() })
    }

    pub fn stats(&self) -> EngineStats {
        self.shared.metrics.snapshot()
    }

    pub fn cache_layout(&self) -> CacheLayout {
        self.shared.layout
    }

    pub fn config(&self) -> &EngineConfig {
        &self.shared.cfg
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.shared.model
    }

    /// Stops admitting, lets queued and running requests finish for at most `grace`, aborts the
    /// rest and joins the engine thread. Later calls (from any clone) return at once.
    pub fn shutdown(&self, grace: Duration) {
        let s = &self.shared;
        s.shutting_down.store(true, Ordering::SeqCst);
        let _ = s.commands.send(Command::Shutdown { deadline: Instant::now() + grace });
        let thread = s.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(thread) = thread {
            if thread.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
    }
}

/// Checks the engine enforces itself; the server validates the wire format before this.
fn validate(req: &GenerateRequest, cfg: &EngineConfig, layout: CacheLayout, vocab: usize) -> Result<(), SubmitError> {
    let invalid = |m: String| Err(SubmitError::Invalid(m));
    let prompt = req.prompt_tokens.len();
    if prompt == 0 {
        return invalid("the prompt is empty".into());
    }
    if req.n == 0 || req.n > cfg.max_num_seqs.min(MAX_COMPLETIONS) {
        return invalid(format!("n = {} is outside 1..={}", req.n, cfg.max_num_seqs.min(MAX_COMPLETIONS)));
    }
    if req.max_tokens == 0 {
        return invalid("max_tokens must be at least 1".into());
    }
    if let Some(t) = req.prompt_tokens.iter().find(|&&t| t as usize >= vocab) {
        return invalid(format!("prompt token {t} is outside the vocabulary (0..{vocab})"));
    }
    let p = &req.sampling;
    // Written so that NaN fails every comparison and is refused.
    let sane = p.temperature >= 0.0
        && p.top_p > 0.0
        && p.top_p <= 1.0
        && (0.0..=1.0).contains(&p.min_p)
        && p.top_k != Some(0)
        && p.repetition_penalty > 0.0
        && p.presence_penalty.is_finite()
        && p.frequency_penalty.is_finite();
    if !sane {
        return invalid(format!("sampling parameters out of range: {p:?}"));
    }
    // One token must fit after the prompt; a longer `max_tokens` just ends at the limit.
    if prompt >= cfg.max_model_len {
        return Err(SubmitError::TooLong { prompt, needed: prompt + req.max_tokens, limit: cfg.max_model_len });
    }
    let blocks = blocks_to_admit(prompt, req.n, layout.block_size);
    if blocks > layout.num_blocks {
        return Err(SubmitError::ExceedsCache { blocks, capacity: layout.num_blocks });
    }
    Ok(())
}
