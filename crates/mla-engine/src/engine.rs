//! `Engine::start` and the `EngineHandle` the server holds: submission checks, statistics and
//! shutdown. The engine thread itself lives in `worker`.

use crate::api::{EngineConfig, EngineEvent, FinishReason, GenerateRequest, SubmitError};
use crate::metrics::Metrics;
use crate::prefix_hash::BlockHash;
use crate::scheduler::blocks_to_admit;
use crate::sequence::MAX_COMPLETIONS;
use crate::stats::EngineStats;
use anyhow::{bail, Context};
pub(crate) use liveness::Liveness;
use mla_core::{Backend, CacheLayout, ModelConfig};
use rank_loads::RankLoads;
use router::Router;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

mod backend_call;
mod client;
mod delivery;
mod gauges;
mod liveness;
mod rank_loads;
mod router;
mod spec_rule;
mod turns;
mod worker;

/// What the handle tells the engine thread.
#[derive(Debug)]
pub(crate) enum Command {
    Submit {
        id: u64,
        // Boxed: the request is far larger than the other commands.
        req: Box<GenerateRequest>,
        events: UnboundedSender<EngineEvent>,
        arrived: Instant,
        /// The attention rank of this engine thread the router chose, and the prompt's block
        /// hashes if it worked them out.
        rank: usize,
        hashes: Vec<BlockHash>,
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

/// How long past its shutdown deadline an engine thread gets to stop: a step in flight ends
/// within it unless the device hangs.
const JOIN_MARGIN: Duration = Duration::from_secs(10);

/// Starts engines; see `Engine::start`.
pub struct Engine;

impl Engine {
    /// Checks `cfg` against the backend and spawns the engine thread, which owns the backend.
    pub fn start(backend: Box<dyn Backend>, cfg: EngineConfig) -> anyhow::Result<EngineHandle> {
        Self::start_replicas(vec![backend], cfg)
    }

    /// Data parallelism: one engine thread per backend (each a full model with its own
    /// schedulers and KV caches), behind one handle that routes each request to an attention
    /// rank of one of them (`router`). Replicas never talk to each other.
    pub fn start_replicas(backends: Vec<Box<dyn Backend>>, cfg: EngineConfig) -> anyhow::Result<EngineHandle> {
        anyhow::ensure!(!backends.is_empty(), "an engine needs at least one backend");
        let model = backends[0].model_config().clone();
        for (i, b) in backends.iter().enumerate() {
            anyhow::ensure!(
                b.model_config() == &model,
                "replica {i} serves a different model configuration than replica 0"
            );
        }
        // Requests are checked against the smallest step any replica was sized for: `n`
        // completions must fit one rank's batch.
        let mut cfg = cfg;
        for b in &backends {
            let step = b.step_limits();
            cfg.max_num_seqs = cfg.max_num_seqs.min(step.rank_seqs);
            cfg.max_num_batched_tokens = cfg.max_num_batched_tokens.min(step.rank_tokens);
        }
        let queued = Arc::new(AtomicUsize::new(0));
        let layouts: Vec<Vec<CacheLayout>> = backends.iter().map(|b| b.cache_layouts()).collect();
        for (i, l) in layouts.iter().enumerate() {
            anyhow::ensure!(!l.is_empty(), "replica {i}: the backend reports no KV cache");
            for layout in l {
                check_config(&cfg, &model, *layout)?;
            }
        }
        let all = || layouts.iter().flatten();
        // One chain of block hashes is looked up in every rank, so the blocks must be alike.
        anyhow::ensure!(
            all().all(|l| l.block_size == layouts[0][0].block_size),
            "the ranks' KV cache blocks differ in size"
        );
        let (router, caches) = Router::new(&cfg.router, cfg.prefix_caching, all().count(), layouts[0][0].block_size)?;
        let mut caches = caches.into_iter();
        let forks_blocks = backends.iter().all(|b| b.forks_blocks());
        let mut replicas = Vec::with_capacity(backends.len());
        for ((i, backend), layouts) in backends.into_iter().enumerate().zip(layouts) {
            let (commands, inbox) = std::sync::mpsc::channel();
            let metrics = Metrics::new(&layouts, cfg.max_model_len);
            let loads = Arc::new(RankLoads::new(layouts.len()));
            let liveness = Arc::new(Liveness::new(cfg.step_watchdog));
            let links = worker::Links {
                inbox,
                metrics: metrics.clone(),
                queued: queued.clone(),
                loads: loads.clone(),
                liveness: liveness.clone(),
            };
            let device = backend.device_name();
            let rank_caches = caches.by_ref().take(layouts.len()).collect();
            let worker = worker::Worker::new(backend, cfg.clone(), links, rank_caches);
            let watch = liveness.clone();
            let thread = std::thread::Builder::new()
                .name(format!("mla-engine-{i}"))
                .spawn(move || {
                    // A bug in the engine thread must not leave `/health` green over a dead
                    // engine; the unwind drops the requests' channels, which end their streams.
                    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run())) {
                        watch.mark_dead(format!("the engine thread panicked: {}", backend_call::panic_text(&p)));
                    }
                })
                .context("spawning the engine thread")?;
            tracing::info!(
                replica = i,
                device = %device,
                attention_ranks = layouts.len(),
                blocks_per_rank = ?layouts.iter().map(|l| l.num_blocks).collect::<Vec<_>>(),
                block_size = layouts[0].block_size,
                max_num_seqs = cfg.max_num_seqs,
                long_prefill_token_threshold = cfg.long_prefill_token_threshold.unwrap_or(0),
                "engine started"
            );
            replicas.push(Replica { layouts, commands, metrics, loads, liveness, thread: Mutex::new(Some(thread)) });
        }
        let shared = Shared {
            cfg,
            model,
            forks_blocks,
            replicas,
            router,
            queued,
            next_id: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
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

/// One engine thread and what the handle shares with it.
struct Replica {
    /// The KV cache of each of its attention ranks.
    layouts: Vec<CacheLayout>,
    commands: Sender<Command>,
    metrics: Metrics,
    /// Tokens of work routed to each of its ranks and not yet ended (see `router`).
    loads: Arc<RankLoads>,
    liveness: Arc<Liveness>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    cfg: EngineConfig,
    model: ModelConfig,
    /// Every backend copies cache blocks (`Backend::forks_blocks`): what an `n`-way request
    /// reserves depends on it (`blocks_to_admit`).
    forks_blocks: bool,
    replicas: Vec<Replica>,
    router: Router,
    /// Requests submitted and not yet scheduled, over all replicas (the `max_queued_requests`
    /// count).
    queued: Arc<AtomicUsize>,
    next_id: AtomicU64,
    shutting_down: AtomicBool,
}

impl Shared {
    /// The cache a request must fit: the smallest of any attention rank, since the router may
    /// send it to any of them.
    fn smallest_layout(&self) -> CacheLayout {
        self.replicas
            .iter()
            .flat_map(|r| r.layouts.iter().copied())
            .min_by_key(|l| l.num_blocks)
            .expect("an engine has at least one rank")
    }

    /// The replica holding attention rank `rank` (numbered over all replicas), and the rank's
    /// index within it.
    fn locate(&self, mut rank: usize) -> (&Replica, usize) {
        for r in &self.replicas {
            if rank < r.layouts.len() {
                return (r, rank);
            }
            rank -= r.layouts.len();
        }
        panic!("the router chose a rank past the last one")
    }
}

/// Cheap to clone; every clone drives the same engine threads.
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
    /// Its engine's death, for a caller that must answer even if the engine thread never
    /// sends another event (a hung step).
    died: tokio::sync::watch::Receiver<Option<String>>,
}

impl RequestStream {
    /// Resolves with the reason once the request's engine has died. A hang is noticed when
    /// someone asks `EngineHandle::fatal_error` (the server does every 200 ms).
    pub fn engine_died(&self) -> impl std::future::Future<Output = String> + Send + 'static {
        let mut died = self.died.clone();
        async move {
            let why = died.wait_for(Option::is_some).await.ok().and_then(|why| why.clone());
            match why {
                Some(why) => why,
                // The engine is gone without a recorded death: never resolve, its channel ends.
                None => std::future::pending().await,
            }
        }
    }

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
        let layout = s.smallest_layout();
        validate(&req, &s.cfg, layout, s.model.vocab_size, s.forks_blocks)?;
        let loads = router::live_loads(s.replicas.iter().map(|r| (&*r.loads, r.liveness.death().is_none())));
        let Some(routed) = s.router.route(&req, &loads) else {
            return Err(SubmitError::Unavailable(self.fatal_error().unwrap_or_default()));
        };
        let (replica, rank) = s.locate(routed.rank);
        let limit = s.cfg.max_queued_requests;
        s.queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| (q < limit).then_some(q + 1))
            .map_err(|_| SubmitError::QueueFull { limit })?;
        let id = s.next_id.fetch_add(1, Ordering::Relaxed);
        let n = req.n;
        let cost = rank_loads::request_cost(&req);
        // Counted before the engine thread sees it, so a burst of submissions spreads out.
        replica.loads.add(rank, cost);
        let (tx, events) = unbounded_channel();
        let arrived = Instant::now();
        let cmd = Command::Submit { id, req: Box::new(req), events: tx, arrived, rank, hashes: routed.hashes };
        if replica.commands.send(cmd).is_err() {
            s.queued.fetch_sub(1, Ordering::SeqCst);
            replica.loads.release(rank, cost);
            return Err(match replica.liveness.death() {
                Some(why) => SubmitError::Unavailable(why),
                None => SubmitError::ShuttingDown,
            });
        }
        Ok(RequestStream { id, events, n, commands: replica.commands.clone(), died: replica.liveness.subscribe() })
    }

    /// Counters summed over every replica, with one `ranks` entry per attention rank, and the
    /// router's decisions.
    pub fn stats(&self) -> EngineStats {
        let mut snapshots = self.shared.replicas.iter().map(|r| r.metrics.snapshot());
        let first = snapshots.next().expect("an engine has at least one replica");
        let mut total = snapshots.fold(first, |mut total, s| {
            total.merge(&s);
            total
        });
        total.routing = self.shared.router.stats();
        total
    }

    /// The KV cache of every attention rank, replica by replica.
    pub fn cache_layouts(&self) -> Vec<CacheLayout> {
        self.shared.replicas.iter().flat_map(|r| r.layouts.iter().copied()).collect()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.shared.cfg
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.shared.model
    }

    /// Why the engine cannot serve, once any replica's backend failed for good (a rank died, a
    /// collective broke, a step outlived its watchdog). The server exits on it.
    pub fn fatal_error(&self) -> Option<String> {
        self.shared.replicas.iter().enumerate().find_map(|(i, r)| {
            r.liveness
                .death()
                .map(|why| if self.shared.replicas.len() > 1 { format!("replica {i}: {why}") } else { why })
        })
    }

    /// Whether shutdown has begun: new requests are refused from then on.
    pub fn is_shutting_down(&self) -> bool {
        self.shared.shutting_down.load(Ordering::SeqCst)
    }

    /// Stops admitting, lets queued and running requests finish for at most `grace`, aborts the
    /// rest and joins the engine thread. Later calls (from any clone) return at once. A thread
    /// stuck in a step (a hung device) is left behind after `JOIN_MARGIN` past the grace period,
    /// so that shutdown always ends and the process can exit.
    pub fn shutdown(&self, grace: Duration) {
        let s = &self.shared;
        s.shutting_down.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + grace;
        for r in &s.replicas {
            let _ = r.commands.send(Command::Shutdown { deadline });
        }
        for (i, r) in s.replicas.iter().enumerate() {
            let thread = r.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
            let Some(thread) = thread else { continue };
            while !thread.is_finished() && Instant::now() < deadline + JOIN_MARGIN {
                std::thread::sleep(Duration::from_millis(10));
            }
            if !thread.is_finished() {
                tracing::error!("engine thread {i} did not stop (stuck in a step); leaving it to the process's exit");
            } else if thread.join().is_err() {
                tracing::error!("engine thread {i} panicked");
            }
        }
    }
}

/// Checks the engine enforces itself; the server validates the wire format before this.
fn validate(
    req: &GenerateRequest,
    cfg: &EngineConfig,
    layout: CacheLayout,
    vocab: usize,
    forks: bool,
) -> Result<(), SubmitError> {
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
    let blocks = blocks_to_admit(prompt, req.n, layout.block_size, forks);
    if blocks > layout.num_blocks {
        return Err(SubmitError::ExceedsCache { blocks, capacity: layout.num_blocks });
    }
    Ok(())
}
