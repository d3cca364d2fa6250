//! A test hook that kills one rank on purpose, so the tests can prove that a rank dying mid-run
//! stops the server cleanly (an error for every accepted request, a non-zero exit) instead of
//! hanging the others in a collective. Set `MLA_TEST_KILL_RANK=RANK:STEP` and rank RANK panics
//! when it starts its STEP-th step (1-based). Unset, it costs one branch per step.

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
