//! Where grammars are compiled: off the async threads, one OS thread per compilation with a
//! stack of known size (`limits::COMPILE_STACK`), at most `limits::compile_threads()` at once, at
//! a lower CPU priority than serving.
//!
//! A compilation recurses as deep as the grammar nests (the checks of `limits` keep that within
//! the stack), and llguidance cannot be interrupted while compiling. So the request waits at most
//! `COMPILE_TIMEOUT` for a slot, then at most as long for its compilation; a compilation still
//! running then keeps its slot until it ends, so abandoned ones cannot pile up. When the server starts
//! shutting down (`close`), every request waiting here is answered at once: the engine takes no
//! new work by then, and the process does not wait for compilations to end.

use super::limits::{COMPILE_STACK, COMPILE_TIMEOUT};
use std::sync::Arc;
use tokio::sync::{oneshot, watch, Semaphore};

pub struct CompileSlots {
    slots: Arc<Semaphore>,
    closing: watch::Sender<bool>,
}

/// Why a compilation gave no result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotCompiled {
    /// No slot came free within `COMPILE_TIMEOUT`.
    Busy,
    /// It ran past `COMPILE_TIMEOUT` (counted from when it got its slot).
    TimedOut,
    /// The server is shutting down.
    ShuttingDown,
    /// The thread could not be started, or the compilation panicked.
    Failed(String),
}

impl CompileSlots {
    pub fn new(slots: usize) -> Self {
        CompileSlots { slots: Arc::new(Semaphore::new(slots)), closing: watch::Sender::new(false) }
    }

    /// Answers every waiting and later request with `ShuttingDown`.
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    /// Runs `job` on a compile thread and waits for its result.
    pub async fn run<T: Send + 'static>(&self, job: impl FnOnce() -> T + Send + 'static) -> Result<T, NotCompiled> {
        let mut closing = self.closing.subscribe();
        let deadline = tokio::time::Instant::now() + COMPILE_TIMEOUT;
        if *closing.borrow_and_update() {
            return Err(NotCompiled::ShuttingDown);
        }
        let permit = tokio::select! {
            permit = tokio::time::timeout_at(deadline, self.slots.clone().acquire_owned()) => match permit {
                Ok(Ok(permit)) => permit,
                Ok(Err(_)) => return Err(NotCompiled::ShuttingDown),
                Err(_) => return Err(NotCompiled::Busy),
            },
            _ = closing.wait_for(|&c| c) => return Err(NotCompiled::ShuttingDown),
        };
        let (tx, rx) = oneshot::channel();
        let deadline = tokio::time::Instant::now() + COMPILE_TIMEOUT;
        std::thread::Builder::new()
            .name("mla-grammar".into())
            .stack_size(COMPILE_STACK)
            .spawn(move || {
                lower_priority();
                // Held until the work ends, whether or not anyone still waits for it.
                let _permit = permit;
                let _ = tx.send(job());
            })
            .map_err(|e| NotCompiled::Failed(format!("cannot start a grammar compile thread: {e}")))?;
        tokio::select! {
            done = tokio::time::timeout_at(deadline, rx) => match done {
                Ok(Ok(result)) => Ok(result),
                Ok(Err(_)) => Err(NotCompiled::Failed("the grammar compiler panicked".into())),
                Err(_) => Err(NotCompiled::TimedOut),
            },
            _ = closing.wait_for(|&c| c) => Err(NotCompiled::ShuttingDown),
        }
    }
}

/// Compiling yields the CPU to the engine and the HTTP threads (nice 10). On Linux the nice
/// value is per thread.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and setpriority take and return plain integers; a failure (EPERM,
        // EACCES) only leaves the priority as it was.
        unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap()
    }

    #[test]
    fn jobs_run_on_a_thread_with_the_known_stack() {
        let slots = CompileSlots::new(1);
        // A recursion a 2 MiB default stack cannot hold runs to its end: 5000 frames of 4 KB.
        fn depth(n: u64) -> u64 {
            let pad = std::hint::black_box([n; 512]);
            if n == 0 {
                0
            } else {
                1 + depth(n - 1).min(pad[7] + n)
            }
        }
        let got = runtime().block_on(slots.run(|| (std::thread::current().name().map(str::to_string), depth(5_000))));
        assert_eq!(got, Ok((Some("mla-grammar".to_string()), 5_000)));
    }

    #[test]
    fn closing_answers_waiting_requests_at_once() {
        let slots = Arc::new(CompileSlots::new(1));
        let rt = runtime();
        let release = Arc::new(std::sync::Barrier::new(2));
        let (s, r) = (slots.clone(), release.clone());
        let first = rt.spawn(async move {
            s.run(move || {
                r.wait();
            })
            .await
        });
        let s = slots.clone();
        let second = rt.spawn(async move { s.run(|| ()).await });
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(50)).await });
        slots.close();
        let started = std::time::Instant::now();
        assert_eq!(rt.block_on(second).unwrap(), Err(NotCompiled::ShuttingDown));
        assert_eq!(rt.block_on(first).unwrap(), Err(NotCompiled::ShuttingDown));
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(rt.block_on(slots.run(|| ())), Err(NotCompiled::ShuttingDown), "and later ones");
        release.wait();
    }
}
