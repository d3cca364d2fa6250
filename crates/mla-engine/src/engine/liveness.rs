//! Whether an engine thread can still serve. It dies when its backend fails for good (a rank
//! died, a collective broke), when the thread itself panics, or when a step has been in flight
//! longer than the step watchdog: a hung device or collective, which the engine thread cannot
//! notice since it is the thread that waits. A hang is found by whoever asks (`/health`, the
//! server's death watch every 200 ms), so it needs no thread of its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::watch;

#[derive(Debug)]
pub(crate) struct Liveness {
    death: Mutex<Option<String>>,
    /// The death, for those who wait on it (the HTTP side of requests in flight).
    died: watch::Sender<Option<String>>,
    epoch: Instant,
    /// When the step in flight started: microseconds since `epoch`, plus one; 0 when none.
    step_started: AtomicU64,
    watchdog: Duration,
}

impl Liveness {
    pub fn new(watchdog: Duration) -> Self {
        Liveness {
            death: Mutex::new(None),
            died: watch::Sender::new(None),
            epoch: Instant::now(),
            step_started: AtomicU64::new(0),
            watchdog,
        }
    }

    /// Records the first reason the engine stopped; later ones are ignored.
    pub fn mark_dead(&self, why: String) {
        let mut death = self.death.lock().unwrap_or_else(PoisonError::into_inner);
        if death.is_none() {
            *death = Some(why.clone());
            self.died.send_replace(Some(why));
        }
    }

    /// Why the engine stopped, if it did: its backend failed, its thread panicked, or its step
    /// in flight has outlived the watchdog (found here, and recorded).
    pub fn death(&self) -> Option<String> {
        let recorded = self.death.lock().unwrap_or_else(PoisonError::into_inner).clone();
        recorded.or_else(|| self.check_hang())
    }

    /// Resolves to the death once there is one (a hang only once someone has asked `death`).
    pub fn subscribe(&self) -> watch::Receiver<Option<String>> {
        self.died.subscribe()
    }

    pub fn step_started(&self) {
        let since = self.epoch.elapsed().as_micros() as u64;
        self.step_started.store(since + 1, Ordering::Relaxed);
    }

    pub fn step_ended(&self) {
        self.step_started.store(0, Ordering::Relaxed);
    }

    fn check_hang(&self) -> Option<String> {
        let started = self.step_started.load(Ordering::Relaxed);
        if started == 0 {
            return None;
        }
        let running = self.epoch.elapsed().saturating_sub(Duration::from_micros(started - 1));
        if running <= self.watchdog {
            return None;
        }
        self.mark_dead(format!(
            "a step has been running for {:.0} s, past the watchdog ({:.0} s, --watchdog-timeout): the device or a \
             rank is hung",
            running.as_secs_f64(),
            self.watchdog.as_secs_f64()
        ));
        self.death.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_past_the_watchdog_is_a_death_and_the_first_reason_stays() {
        let l = Liveness::new(Duration::from_millis(30));
        let mut watch = l.subscribe();
        l.step_started();
        assert_eq!(l.death(), None);
        l.step_ended();
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(l.death(), None, "no step in flight, no hang");
        l.step_started();
        std::thread::sleep(Duration::from_millis(40));
        let why = l.death().expect("hung");
        assert!(why.contains("past the watchdog"), "{why}");
        assert!(watch.has_changed().unwrap());
        assert_eq!(watch.borrow_and_update().as_deref(), Some(why.as_str()));
        l.mark_dead("later".into());
        assert_eq!(l.death().as_deref(), Some(why.as_str()));
    }
}
