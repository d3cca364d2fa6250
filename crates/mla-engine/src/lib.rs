//! Continuous-batching engine: admission, scheduling of prefill and decode steps over the paged
//! latent cache, preemption, and the engine thread that drives a `Backend`.
//!
//! Public surface (see `api`):
//! - `Engine::start(backend: Box<dyn Backend>, cfg: EngineConfig) -> anyhow::Result<EngineHandle>`
//!   spawns the engine thread, which owns the backend.
//! - `EngineHandle` is `Clone + Send + Sync`:
//!   - `submit(&self, req: GenerateRequest) -> Result<RequestStream, SubmitError>`;
//!   - `stats(&self) -> EngineStats`;
//!   - `cache_layout(&self)`, `config(&self)`, `model_config(&self)`;
//!   - `shutdown(&self, grace: Duration)`: stop admitting, let running requests finish for at most
//!     `grace`, abort the rest, join the thread.
//! - `RequestStream { id, events: tokio::sync::mpsc::UnboundedReceiver<EngineEvent> }` with
//!   `abort(&self)` and `finish_choice(&self, index, reason)` (ends one completion, e.g. on a
//!   stop string, and leaves the others running); dropping the stream aborts the request within
//!   one engine step.
//!
//! Modules: `block_manager` (free list, ref-counted blocks, RAII `BlockTable`), `cache_index`
//! (every rank's cached block hashes, read by the router on the submitting threads), `scheduler`
//! (continuous batching policy, public so it can be tested and reused per DP rank), `engine`
//! (the handle and the engine thread), `metrics` (counters and histograms), `stats` (the
//! snapshot they give), `request_stats`
//! (what is recorded about each request when it ends), `sequence`
//! (per-request state; `draw_seed` fixes how each draw's seed is derived).

pub mod api;
pub mod block_manager;
mod buckets;
pub mod cache_index;
mod engine;
mod histogram;
mod id_map;
mod metrics;
pub mod prefix_hash;
mod prompt_logprobs;
mod request_stats;
pub mod scheduler;
mod sequence;
mod stats;

pub use api::*;
pub use engine::{Engine, EngineHandle, RequestStream};
pub use histogram::Histogram;
pub use request_stats::{FinishCounts, RequestStats};
pub use sequence::draw_seed;
pub use stats::{EngineStats, MaskStats, RankStats, RoutingStats, StepCounts};
