//! What one request's access line says beyond method, path and status, gathered while it runs.
//!
//! The middleware creates the record when the request arrives and puts it in the request's
//! extensions; the handler adds the response id, and the generation, when it ends or is dropped
//! (a client that went away), adds its token counts, finish reasons and the first token's time.
//! The line is written from it once the response body has ended or been dropped.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// One request's record, shared by the middleware, the handler and the generation.
#[derive(Clone)]
pub struct AccessRecord {
    arrived: Instant,
    fields: Arc<Mutex<Fields>>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fields {
    /// The response's `id` (`chatcmpl-...`, `cmpl-...`), for finding a client's report in the log.
    pub request_id: Option<String>,
    pub stream: bool,
    /// Only requests that reached the engine have one.
    pub generation: Option<GenerationOutcome>,
}

/// What a generation reports when it ends: finished, failed, or dropped half way.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationOutcome {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// Each choice's finish reason, each reason once in choice order (`stop,length` for two
    /// choices that ended differently); `abort` for choices cut short, `error` if the engine
    /// failed.
    pub finish: String,
    pub first_token: Option<Instant>,
}

impl AccessRecord {
    pub fn new() -> Self {
        AccessRecord { arrived: Instant::now(), fields: Arc::default() }
    }

    /// When the request reached the router: latency and time to first token count from here.
    pub fn arrived(&self) -> Instant {
        self.arrived
    }

    /// The response's id and whether it streams, once the handler has them.
    pub fn describe(&self, request_id: &str, stream: bool) {
        let mut f = self.lock();
        f.request_id = Some(request_id.to_string());
        f.stream = stream;
    }

    pub fn generation_ended(&self, outcome: GenerationOutcome) {
        self.lock().generation = Some(outcome);
    }

    pub fn fields(&self) -> Fields {
        self.lock().clone()
    }

    fn lock(&self) -> MutexGuard<'_, Fields> {
        // Nothing panics while holding it; a poisoned record is still worth logging.
        self.fields.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Default for AccessRecord {
    fn default() -> Self {
        Self::new()
    }
}
