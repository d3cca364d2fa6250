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
//!   `abort(&self)`; dropping the stream aborts the request within one engine step.

pub mod api;
pub mod block_manager;
pub mod scheduler;
mod sequence;

pub use api::*;
