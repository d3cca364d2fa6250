//! The engine's counters and latency histograms, shared between the engine thread (writer) and
//! `EngineHandle::stats` (reader).

use crate::api::{EngineStats, FinishReason, Histogram, RankStats};
use mla_core::CacheLayout;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

// Bucket bounds in seconds, close to vLLM's so dashboards built for it read the same. The
// inter-token bounds start lower because MLA decode on a GPU runs at a few milliseconds a token.
const TTFT_BOUNDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
const ITL_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const REQUEST_BOUNDS: &[f64] = &[
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Handle on the shared statistics; the engine thread is the only writer.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    stats: Arc<Mutex<EngineStats>>,
}

impl Metrics {
    /// Statistics of an engine thread whose attention ranks have these caches.
    pub fn new(layouts: &[CacheLayout]) -> Self {
        let ranks: Vec<RankStats> = layouts
            .iter()
            .map(|l| RankStats { kv_capacity_tokens: l.capacity_tokens(), ..Default::default() })
            .collect();
        let stats = EngineStats {
            kv_capacity_tokens: layouts.iter().map(CacheLayout::capacity_tokens).sum(),
            ranks,
            time_to_first_token: Histogram::with_bounds(TTFT_BOUNDS),
            inter_token_latency: Histogram::with_bounds(ITL_BOUNDS),
            e2e_latency: Histogram::with_bounds(REQUEST_BOUNDS),
            queue_time: Histogram::with_bounds(REQUEST_BOUNDS),
            ..Default::default()
        };
        Metrics { stats: Arc::new(Mutex::new(stats)) }
    }

    // Statistics stay readable even if the engine thread panicked while holding the lock.
    pub fn lock(&self) -> MutexGuard<'_, EngineStats> {
        self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn snapshot(&self) -> EngineStats {
        self.lock().clone()
    }

    pub fn count_finished(&self, reason: FinishReason, completions: u64) {
        let mut s = self.lock();
        match reason {
            FinishReason::Stop => s.finished_stop += completions,
            FinishReason::Length => s.finished_length += completions,
            FinishReason::Abort => s.finished_abort += completions,
        }
    }
}
