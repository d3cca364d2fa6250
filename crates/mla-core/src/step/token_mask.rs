//! Which tokens one draw may pick (structured output), as a bitmask over the vocabulary.
//!
//! The mask of a draw depends on the token drawn just before, so it cannot be known when the
//! step is planned without putting its computation between two steps, where the device idles.
//! Instead the plan carries an empty slot; the engine fills it while the backend runs the
//! forward pass, and the sampler waits for it only when it is about to draw. A writer dropped
//! without filling its slot (the engine failed) releases the waiter with an error rather than
//! leaving a step hanging.
//!
//! A sequence verifying drafts (speculative decoding) draws once per verify row, each row after
//! one more draft: its slot holds one mask per row, laid end to end, filled at once by the one
//! writer, and each row's draw reads its own (`TokenMask::row`).

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
    /// Masks the slot holds, one per draw (a verify step's rows), each `mask_words(vocab)` long.
    rows: usize,
}

/// The allowed tokens of one draw, possibly still being computed. Clones share the slot; `row`
/// is which of the slot's masks this draw reads.
#[derive(Clone)]
pub struct TokenMask {
    slot: Arc<Slot>,
    row: usize,
}

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
    #[error("structured-output mask row {row} asked of a slot of {rows}")]
    NoSuchRow { row: usize, rows: usize },
}

/// How long a sampler waits for a mask. The engine fills masks while the forward pass runs
/// (typically well under a millisecond each); a wait this long means something is broken, and
/// the step fails instead of hanging.
pub const MASK_WAIT: Duration = Duration::from_secs(60);

impl TokenMask {
    /// An empty slot for one draw and the writer that fills it.
    pub fn pending() -> (TokenMask, MaskWriter) {
        Self::pending_rows(1)
    }

    /// An empty slot for `rows` draws (a sequence's verify rows) and the writer that fills it
    /// with their masks end to end. The mask is row 0's; `row` gives the others.
    pub fn pending_rows(rows: usize) -> (TokenMask, MaskWriter) {
        let slot = Arc::new(Slot { state: Mutex::new(State::Pending), changed: Condvar::new(), rows: rows.max(1) });
        (TokenMask { slot: slot.clone(), row: 0 }, MaskWriter(Some(slot)))
    }

    /// Masks the slot holds (1 but for a sequence verifying drafts).
    pub fn rows(&self) -> usize {
        self.slot.rows
    }

    /// The same slot read at row `row` (verify row `row`'s draw).
    pub fn row(&self, row: usize) -> TokenMask {
        TokenMask { slot: self.slot.clone(), row }
    }

    /// A mask known up front.
    pub fn ready(words: impl Into<MaskWords>) -> TokenMask {
        let (mask, writer) = TokenMask::pending();
        writer.fill(words);
        mask
    }

    /// This draw's mask, once the engine has filled the slot, checked against the vocabulary.
    pub fn wait(&self, vocab_size: usize, timeout: Duration) -> Result<MaskWords, MaskError> {
        let rows = self.slot.rows;
        if self.row >= rows {
            return Err(MaskError::NoSuchRow { row: self.row, rows });
        }
        let state = self.slot.state.lock().unwrap_or_else(|p| p.into_inner());
        let (state, _) = self
            .slot
            .changed
            .wait_timeout_while(state, timeout, |s| matches!(s, State::Pending))
            .unwrap_or_else(|p| p.into_inner());
        let words = match &*state {
            State::Ready(w) => w.clone(),
            State::Abandoned => return Err(MaskError::Abandoned),
            State::Pending => return Err(MaskError::TimedOut(timeout)),
        };
        let need = mask_words(vocab_size);
        if words.len() != need * rows {
            return Err(MaskError::WrongSize { have: words.len(), need: need * rows, vocab: vocab_size });
        }
        Ok(match rows {
            1 => words,
            _ => words[self.row * need..(self.row + 1) * need].into(),
        })
    }

    /// Whether the engine has filled (or given up on) the mask.
    pub fn is_filled(&self) -> bool {
        !matches!(*self.slot.state.lock().unwrap_or_else(|p| p.into_inner()), State::Pending)
    }

    /// The slot's words if already filled (for comparisons of finished plans).
    fn peek(&self) -> Option<MaskWords> {
        match &*self.slot.state.lock().unwrap_or_else(|p| p.into_inner()) {
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

/// Two masks are equal when they read the same row of slots of as many rows filled with the
/// same words (plans compare in tests).
impl PartialEq for TokenMask {
    fn eq(&self, other: &Self) -> bool {
        let same_shape = self.row == other.row && self.slot.rows == other.slot.rows;
        same_shape
            && (Arc::ptr_eq(&self.slot, &other.slot)
                || matches!((self.peek(), other.peek()), (Some(a), Some(b)) if a == b))
    }
}

/// Plans cross process boundaries only between ranks of one step; a mask is sent as its slot's
/// shape and words, waiting for them if the engine is still computing them.
impl serde::Serialize for TokenMask {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let state = self.slot.state.lock().unwrap_or_else(|p| p.into_inner());
        let (state, _) = self
            .slot
            .changed
            .wait_timeout_while(state, MASK_WAIT, |st| matches!(st, State::Pending))
            .unwrap_or_else(|p| p.into_inner());
        let State::Ready(words) = &*state else {
            return Err(serde::ser::Error::custom("structured-output token mask was never computed"));
        };
        let mut t = s.serialize_tuple(3)?;
        t.serialize_element(&self.slot.rows)?;
        t.serialize_element(&self.row)?;
        t.serialize_element(&words[..])?;
        t.end()
    }
}

impl<'de> serde::Deserialize<'de> for TokenMask {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (rows, row, words): (usize, usize, Vec<u32>) = serde::Deserialize::deserialize(d)?;
        let (mask, writer) = TokenMask::pending_rows(rows);
        writer.fill(words);
        Ok(mask.row(row))
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
        assert_eq!(json, "[1,0,[7,0,1]]");
        let back: TokenMask = serde_json::from_str(&json).unwrap();
        assert_eq!(back, mask);
        let (rows, writer) = TokenMask::pending_rows(3);
        writer.fill(vec![1u32, 2, 4]);
        let back: TokenMask = serde_json::from_str(&serde_json::to_string(&rows.row(2)).unwrap()).unwrap();
        assert_eq!(back, rows.row(2));
        assert_ne!(back, rows.row(1));
        assert_eq!(&back.wait(32, MASK_WAIT).unwrap()[..], &[4]);
    }

    #[test]
    fn each_row_of_a_verify_slot_reads_its_own_mask() {
        let (mask, writer) = TokenMask::pending_rows(3);
        let row2 = mask.row(2);
        let waiter = std::thread::spawn(move || row2.wait(40, MASK_WAIT));
        writer.fill(vec![1u32, 0, 2, 0, 4, 1 << 7]);
        assert_eq!(&waiter.join().unwrap().unwrap()[..], &[4, 1 << 7]);
        assert_eq!(&mask.wait(40, MASK_WAIT).unwrap()[..], &[1, 0]);
        assert_eq!(&mask.row(1).wait(40, MASK_WAIT).unwrap()[..], &[2, 0]);
        assert_eq!(mask.row(3).wait(40, MASK_WAIT), Err(MaskError::NoSuchRow { row: 3, rows: 3 }));
        // The slot must hold every row: two rows' words in a slot of three is refused.
        let (short, writer) = TokenMask::pending_rows(3);
        writer.fill(vec![1u32, 0, 2, 0]);
        assert!(matches!(short.row(0).wait(40, MASK_WAIT), Err(MaskError::WrongSize { have: 4, need: 6, .. })));
    }
}
