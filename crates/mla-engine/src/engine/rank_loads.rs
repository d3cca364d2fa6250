//! The work each attention rank of one engine thread has taken on, in tokens its live requests
//! may hold (`request_cost`). The handle adds a request's cost when it routes the request to a
//! rank, before the engine thread sees it, so a burst of submissions spreads out; the engine
//! thread takes it off when the request ends.

use crate::api::GenerateRequest;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a request adds to its rank's load: the tokens its completions hold at most.
pub(crate) fn request_cost(req: &GenerateRequest) -> u64 {
    (req.n * (req.prompt_tokens.len() + req.max_tokens)) as u64
}

#[derive(Debug)]
pub(crate) struct RankLoads(Vec<AtomicU64>);

impl RankLoads {
    pub fn new(ranks: usize) -> Self {
        RankLoads((0..ranks).map(|_| AtomicU64::new(0)).collect())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn get(&self, rank: usize) -> u64 {
        self.0[rank].load(Ordering::SeqCst)
    }

    pub fn add(&self, rank: usize, cost: u64) {
        self.0[rank].fetch_add(cost, Ordering::SeqCst);
    }

    pub fn release(&self, rank: usize, cost: u64) {
        self.0[rank].fetch_sub(cost, Ordering::SeqCst);
    }
}
