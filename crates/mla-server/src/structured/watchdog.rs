//! Cancels grammar work that outlives its deadline.
//!
//! llguidance cannot be told "stop after 50 ms", but a cancellable matcher checks a flag at
//! points inside its work and gives up when it is set (`CancellationHandle`). A mask
//! computation arms this watchdog with its deadline and its matcher's handle and disarms it when
//! done; one thread sleeps until the earliest armed deadline and sets the flags of those past it.
//! Arming costs a lock and a map insertion; the thread wakes only when a deadline passes.

use llguidance::CancellationHandle;
use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Instant;

pub struct Watchdog {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Keyed by deadline, then by an arming number (deadlines may coincide).
    armed: BTreeMap<(Instant, u64), CancellationHandle>,
    next: u64,
    closed: bool,
}

/// Disarms on drop.
pub struct Armed<'a> {
    watchdog: &'a Watchdog,
    key: (Instant, u64),
}

impl Watchdog {
    /// Starts the watchdog's thread; it ends when the watchdog is dropped.
    pub fn new() -> std::io::Result<Watchdog> {
        let shared = Arc::new(Shared { state: Mutex::new(State::default()), changed: Condvar::new() });
        let watched = shared.clone();
        std::thread::Builder::new().name("mla-grammar-watchdog".into()).spawn(move || watch(&watched))?;
        Ok(Watchdog { shared })
    }

    /// Cancels `handle` at `deadline` unless the returned guard is dropped first; at once when
    /// the deadline has passed already.
    pub fn arm(&self, deadline: Instant, handle: CancellationHandle) -> Armed<'_> {
        if deadline <= Instant::now() {
            handle.cancel();
        }
        let mut state = self.lock();
        let key = (deadline, state.next);
        state.next += 1;
        let earliest = state.armed.keys().next().is_none_or(|&first| key < first);
        state.armed.insert(key, handle);
        if earliest {
            self.shared.changed.notify_one();
        }
        Armed { watchdog: self, key }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.watchdog.lock().armed.remove(&self.key);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.lock().closed = true;
        self.shared.changed.notify_one();
    }
}

fn watch(shared: &Shared) {
    let mut state = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
    while !state.closed {
        let now = Instant::now();
        while let Some(entry) = state.armed.first_entry() {
            if entry.key().0 > now {
                break;
            }
            entry.remove().cancel();
        }
        state = match state.armed.keys().next() {
            Some(&(deadline, _)) => {
                shared.changed.wait_timeout(state, deadline - now).unwrap_or_else(PoisonError::into_inner).0
            }
            None => shared.changed.wait(state).unwrap_or_else(PoisonError::into_inner),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn handles_are_cancelled_at_their_deadline_unless_disarmed() {
        let dog = Watchdog::new().unwrap();
        let (late, early, disarmed) =
            (CancellationHandle::default(), CancellationHandle::default(), Default::default());
        let start = Instant::now();
        let _late = dog.arm(start + Duration::from_millis(300), late.clone());
        let _early = dog.arm(start + Duration::from_millis(30), early.clone());
        drop(dog.arm(start + Duration::from_millis(10), CancellationHandle::clone(&disarmed)));
        while !early.is_cancelled() {
            assert!(start.elapsed() < Duration::from_secs(5), "the early deadline never fired");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(start.elapsed() >= Duration::from_millis(30));
        assert!(!late.is_cancelled(), "the later deadline fired with the earlier one");
        std::thread::sleep(Duration::from_millis(50));
        assert!(!disarmed.is_cancelled(), "a disarmed handle was cancelled");
        while !late.is_cancelled() {
            assert!(start.elapsed() < Duration::from_secs(5), "the late deadline never fired");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(start.elapsed() >= Duration::from_millis(300));
        let past = CancellationHandle::default();
        let _past = dog.arm(Instant::now(), past.clone());
        assert!(past.is_cancelled(), "a deadline already past cancels at once");
    }
}
