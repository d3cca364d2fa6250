//! The engine's counters and latency histograms, shared between the engine thread (writer) and
//! `EngineHandle::stats` (reader).

use crate::api::FinishReason;
use crate::buckets;
use crate::histogram::Histogram;
use crate::request_stats::RequestStats;
use crate::stats::{EngineStats, RankStats};
use mla_core::CacheLayout;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Handle on the shared statistics; the engine thread is the only writer.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    stats: Arc<Mutex<EngineStats>>,
}

impl Metrics {
    /// Statistics of an engine thread whose attention ranks have these caches, serving
    /// sequences of at most `max_model_len` tokens.
    pub fn new(layouts: &[CacheLayout], max_model_len: usize) -> Self {
        let ranks: Vec<RankStats> = layouts
            .iter()
            .map(|l| RankStats { kv_capacity_tokens: l.capacity_tokens(), ..Default::default() })
            .collect();
        let stats = EngineStats {
            kv_capacity_tokens: layouts.iter().map(CacheLayout::capacity_tokens).sum(),
            ranks,
            time_to_first_token: Histogram::with_bounds(buckets::TTFT),
            inter_token_latency: Histogram::with_bounds(buckets::PER_TOKEN),
            e2e_latency: Histogram::with_bounds(buckets::REQUEST_TIME),
            queue_time: Histogram::with_bounds(buckets::REQUEST_TIME),
            iteration_tokens: Histogram::with_bounds(buckets::ITERATION_TOKENS),
            requests: RequestStats::new(max_model_len),
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
