//! Test hooks that break a server on purpose, so the tests can prove it stops cleanly (an error
//! for every accepted request, `/health` 503, a non-zero exit) instead of hanging:
//! `MLA_TEST_KILL_RANK=RANK:STEP` and rank RANK panics when it starts its STEP-th step
//! (1-based); `MLA_TEST_HANG_STEP=STEP` and the engine's STEP-th step never ends, as on a hung
//! device. Unset, each costs one branch per step.

use std::sync::OnceLock;

pub const KILL_RANK_ENV: &str = "MLA_TEST_KILL_RANK";

/// `(rank, step)` from the environment, read once. A malformed value is a mistake in the test's
/// setup: it panics at first use, naming the variable.
fn target() -> Option<(usize, u64)> {
    static TARGET: OnceLock<Option<(usize, u64)>> = OnceLock::new();
    *TARGET.get_or_init(|| {
        let v = std::env::var(KILL_RANK_ENV).ok()?;
        let parsed = v.split_once(':').and_then(|(r, s)| Some((r.parse().ok()?, s.parse().ok()?)));
        Some(parsed.unwrap_or_else(|| panic!("{KILL_RANK_ENV}={v}: expected RANK:STEP, e.g. 1:5")))
    })
}

/// Panics if the hook names this rank and step.
pub fn maybe_kill(rank: usize, step: u64) {
    if target() == Some((rank, step)) {
        panic!("rank {rank} killed at step {step} by {KILL_RANK_ENV} (a test hook)");
    }
}

pub const HANG_STEP_ENV: &str = "MLA_TEST_HANG_STEP";

/// Blocks the calling thread for good if the hook names this step (the engine's step count).
pub fn maybe_hang(step: u64) {
    static TARGET: OnceLock<Option<u64>> = OnceLock::new();
    let target = *TARGET.get_or_init(|| {
        let v = std::env::var(HANG_STEP_ENV).ok()?;
        Some(v.parse().unwrap_or_else(|_| panic!("{HANG_STEP_ENV}={v}: expected a step number, e.g. 20")))
    });
    if target == Some(step) {
        tracing::warn!("step {step} hangs on purpose ({HANG_STEP_ENV}, a test hook)");
        loop {
            std::thread::park();
        }
    }
}
