//! Which tokens one draw may pick (structured output), as a bitmask over the vocabulary.
//!
//! The mask of a draw depends on the token drawn just before, so it cannot be known when the
//! step is planned without putting its computation between two steps, where the device idles.
//! Instead the plan carries an empty slot; the engine fills it while the backend runs the
//! forward pass, and the sampler waits for it only when it is about to draw. A writer dropped
//! without filling its slot (the engine failed) releases the waiter with an error rather than
//! leaving a step hanging.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Bit `t % 32` of word `t / 32` set: token `t` may be drawn.
pub type MaskWords = Arc<[u32]>;

/// Words a mask over `vocab_size` tokens has.
pub fn mask_words(vocab_size: usize) -> usize {
    vocab_size.div_ceil(32)
}

/// Whether `words` allows `token` (tokens past the mask are not allowed).
pub fn allows(words: &[u32], token: u32) -> bool {
    words.get(token as usize / 32).is_some_and(|w| w >> (token % 32) & 1 == 1)
}

enum State {
    Pending,
    Ready(MaskWords),
    Abandoned,
}

struct Slot {
    state: Mutex<State>,
    changed: Condvar,
}

/// The allowed tokens of one draw, possibly still being computed. Clones share the slot.
#[derive(Clone)]
pub struct TokenMask(Arc<Slot>);

/// The one handle that fills a `TokenMask`.
pub struct MaskWriter(Option<Arc<Slot>>);

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MaskError {
    #[error("the engine gave up computing a structured-output token mask")]
    Abandoned,
    #[error("no structured-output token mask after {0:?}")]
    TimedOut(Duration),
    #[error("the structured-output token mask has {have} words, the vocabulary of {vocab} tokens needs {need}")]
    WrongSize { have: usize, need: usize, vocab: usize },
}

/// How long a sampler waits for a mask. The engine fills masks while the forward pass runs
/// (typically well under a millisecond each); a wait this long means something is broken, and
/// the step fails instead of hanging.
pub const MASK_WAIT: Duration = Duration::from_secs(60);

impl TokenMask {
    /// An empty slot and the writer that fills it.
    pub fn pending() -> (TokenMask, MaskWriter) {
        let slot = Arc::new(Slot { state: Mutex::new(State::Pending), changed: Condvar::new() });
        (TokenMask(slot.clone()), MaskWriter(Some(slot)))
    }

    /// A mask known up front.
    pub fn ready(words: impl Into<MaskWords>) -> TokenMask {
        let (mask, writer) = TokenMask::pending();
        writer.fill(words);
        mask
    }

    /// The mask, once the engine has filled it, checked against the vocabulary.
    pub fn wait(&self, vocab_size: usize, timeout: Duration) -> Result<MaskWords, MaskError> {
        let state = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        let (state, _) = self
            .0
            .changed
            .wait_timeout_while(state, timeout, |s| matches!(s, State::Pending))
            .unwrap_or_else(|p| p.into_inner());
        let words = match &*state {
            State::Ready(w) => w.clone(),
            State::Abandoned => return Err(MaskError::Abandoned),
            State::Pending => return Err(MaskError::TimedOut(timeout)),
        };
        let need = mask_words(vocab_size);
        if words.len() != need {
            return Err(MaskError::WrongSize { have: words.len(), need, vocab: vocab_size });
        }
        Ok(words)
    }

    /// Whether the engine has filled (or given up on) the mask.
    pub fn is_filled(&self) -> bool {
        !matches!(*self.0.state.lock().unwrap_or_else(|p| p.into_inner()), State::Pending)
    }

    /// The words if already filled (for comparisons and serialisation of finished plans).
    fn peek(&self) -> Option<MaskWords> {
        match &*self.0.state.lock().unwrap_or_else(|p| p.into_inner()) {
            State::Ready(w) => Some(w.clone()),
            _ => None,
        }
    }
}

impl MaskWriter {
    /// A writer with no slot (a placeholder for one already used).
    pub fn spent() -> MaskWriter {
        MaskWriter(None)
    }

    pub fn fill(mut self, words: impl Into<MaskWords>) {
        self.set(State::Ready(words.into()));
    }

    fn set(&mut self, new: State) {
        if let Some(slot) = self.0.take() {
            *slot.state.lock().unwrap_or_else(|p| p.into_inner()) = new;
            slot.changed.notify_all();
        }
    }
}

impl Drop for MaskWriter {
    fn drop(&mut self) {
        self.set(State::Abandoned);
    }
}

impl std::fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.peek() {
            Some(w) => write!(f, "TokenMask({} allowed)", w.iter().map(|x| x.count_ones()).sum::<u32>()),
            None => f.write_str("TokenMask(pending)"),
        }
    }
}

/// Two masks are equal when both are filled with the same words (plans compare in tests).
impl PartialEq for TokenMask {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || matches!((self.peek(), other.peek()), (Some(a), Some(b)) if a == b)
    }
}

/// Plans cross process boundaries only between ranks of one step; a mask is sent as its words,
/// waiting for them if the engine is still computing them.
impl serde::Serialize for TokenMask {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let state = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        let (state, _) = self
            .0
            .changed
            .wait_timeout_while(state, MASK_WAIT, |st| matches!(st, State::Pending))
            .unwrap_or_else(|p| p.into_inner());
        match &*state {
            State::Ready(w) => s.collect_seq(w.iter()),
            _ => Err(serde::ser::Error::custom("structured-output token mask was never computed")),
        }
    }
}

impl<'de> serde::Deserialize<'de> for TokenMask {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let words: Vec<u32> = serde::Deserialize::deserialize(d)?;
        Ok(TokenMask::ready(words))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filled_mask_is_seen_by_a_waiting_thread() {
        let (mask, writer) = TokenMask::pending();
        let waiter = std::thread::spawn(move || mask.wait(40, MASK_WAIT));
        std::thread::sleep(Duration::from_millis(20));
        writer.fill(vec![0b101, 1 << 7]);
        let words = waiter.join().unwrap().unwrap();
        assert!(allows(&words, 0) && !allows(&words, 1) && allows(&words, 2) && allows(&words, 39));
        assert!(!allows(&words, 38) && !allows(&words, 64), "tokens past the mask are refused");
    }

    #[test]
    fn a_dropped_writer_releases_the_waiter_with_an_error() {
        let (mask, writer) = TokenMask::pending();
        drop(writer);
        assert_eq!(mask.wait(32, MASK_WAIT), Err(MaskError::Abandoned));
    }

    #[test]
    fn a_mask_of_the_wrong_size_is_refused() {
        let mask = TokenMask::ready(vec![1u32; 3]);
        assert!(matches!(mask.wait(100, MASK_WAIT), Err(MaskError::WrongSize { have: 3, need: 4, .. })));
        let (pending, _writer) = TokenMask::pending();
        let short = Duration::from_millis(5);
        assert_eq!(pending.wait(32, short), Err(MaskError::TimedOut(short)));
    }

    #[test]
    fn serialisation_round_trips_the_words() {
        let mask = TokenMask::ready(vec![7u32, 0, 1]);
        let json = serde_json::to_string(&mask).unwrap();
        assert_eq!(json, "[7,0,1]");
        let back: TokenMask = serde_json::from_str(&json).unwrap();
        assert_eq!(back, mask);
    }
}
