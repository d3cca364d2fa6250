//! Stop strings on streamed text.
//!
//! Text arrives in detokenizer deltas, and a stop string can span several of them. Text that
//! could still be the beginning of a stop string is held back until the next delta decides; text
//! that cannot is released at once. On a match the text before the stop string is released, the
//! stop string itself is not (OpenAI semantics), and the caller ends the request.
//!
//! When several stop strings match, the one that is completed first in the text wins (the point
//! where a token-by-token check would have stopped); if two complete at the same character, the
//! longer one, which starts earlier, wins; equal strings go to the lower index.
//!
//! Matching runs for every generated token of every request on the async runtime's workers, so
//! its cost must not grow with what a client can send (up to 64 stop strings of 1024 bytes):
//! the stop strings are compiled once per request into an Aho-Corasick automaton over bytes,
//! shared by the request's completions, and each delta advances it byte by byte (amortised
//! constant work per byte through the failure links). The automaton's state also says how much
//! to hold back: its depth is the longest suffix of the text that is a proper prefix of some stop
//! string. That depth is why it is written here: the `aho-corasick` crate does not expose it.

use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
#[error("stop strings must not be empty")]
pub struct EmptyStopString;

/// The result of feeding one delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopCheck {
    /// No stop string yet; `text` is safe to send.
    Continue { text: String },
    /// `stop_strings()[index]` matched; `text` is the last text to send, then end the request.
    Stopped { text: String, index: usize },
}

/// State 0 is the root (the empty string).
const ROOT: u32 = 0;

#[derive(Debug, Default)]
struct State {
    /// Trie edges, sorted by byte (binary search keeps 64K states at a few MB).
    edges: Vec<(u8, u32)>,
    /// The state of the longest proper suffix of this state's string that is also in the trie.
    fail: u32,
    /// Length in bytes of this state's string.
    depth: u32,
    /// The stop string that ends here and wins the tie rules: the longest one that is a suffix
    /// of this state's string, the lowest index among equal strings.
    output: Option<u32>,
}

/// The stop strings of one request, compiled; immutable and shared by its completions.
#[derive(Debug)]
pub struct StopAutomaton {
    stops: Vec<String>,
    states: Vec<State>,
}

impl StopAutomaton {
    pub fn new(stops: Vec<String>) -> Result<Self, EmptyStopString> {
        if stops.iter().any(String::is_empty) {
            return Err(EmptyStopString);
        }
        let mut states = vec![State::default()];
        for (index, stop) in stops.iter().enumerate() {
            let mut at = ROOT;
            for &b in stop.as_bytes() {
                at = match edge(&states[at as usize], b) {
                    Some(next) => next,
                    None => {
                        let next = states.len() as u32;
                        let depth = states[at as usize].depth + 1;
                        states.push(State { depth, ..State::default() });
                        let edges = &mut states[at as usize].edges;
                        let slot = edges.partition_point(|&(e, _)| e < b);
                        edges.insert(slot, (b, next));
                        next
                    }
                };
            }
            // A repeated stop string keeps its first index.
            states[at as usize].output.get_or_insert(index as u32);
        }
        // Failure links breadth first, so a state's link is final before its children need it.
        let mut queue = std::collections::VecDeque::from([ROOT]);
        while let Some(at) = queue.pop_front() {
            for k in 0..states[at as usize].edges.len() {
                let (b, child) = states[at as usize].edges[k];
                let fail = if at == ROOT { ROOT } else { step(&states, states[at as usize].fail, b) };
                let inherited = states[fail as usize].output;
                let child_state = &mut states[child as usize];
                child_state.fail = fail;
                // Its own stop string, if any, is longer than any reached through the link.
                child_state.output = child_state.output.or(inherited);
                queue.push_back(child);
            }
        }
        Ok(StopAutomaton { stops, states })
    }

    pub fn stop_strings(&self) -> &[String] {
        &self.stops
    }
}

fn edge(state: &State, b: u8) -> Option<u32> {
    state.edges.binary_search_by_key(&b, |&(e, _)| e).ok().map(|i| state.edges[i].1)
}

/// The state after reading `b` in state `at`: follow failure links until an edge takes `b`.
fn step(states: &[State], mut at: u32, b: u8) -> u32 {
    loop {
        if let Some(next) = edge(&states[at as usize], b) {
            return next;
        }
        if at == ROOT {
            return ROOT;
        }
        at = states[at as usize].fail;
    }
}

/// One completion's matching state over a shared automaton; cloning one starts another
/// completion at the same point.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    automaton: Arc<StopAutomaton>,
    state: u32,
    /// Text received but not yet released: always the automaton state's string, or a little
    /// more to keep a character whole.
    held: String,
    /// Index of the stop string that matched, once one has.
    stopped: Option<usize>,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Result<Self, EmptyStopString> {
        Ok(Self::shared(Arc::new(StopAutomaton::new(stops)?)))
    }

    pub fn shared(automaton: Arc<StopAutomaton>) -> Self {
        StopMatcher { automaton, state: ROOT, held: String::new(), stopped: None }
    }

    pub fn stop_strings(&self) -> &[String] {
        self.automaton.stop_strings()
    }

    /// Feeds the next delta. After a `Stopped` result every further delta is ignored (`Stopped`
    /// again with empty text), so a caller that keeps feeding cannot leak text past the stop.
    pub fn push(&mut self, delta: &str) -> StopCheck {
        if let Some(index) = self.stopped {
            return StopCheck::Stopped { text: String::new(), index };
        }
        let states = &self.automaton.states;
        for (i, &b) in delta.as_bytes().iter().enumerate() {
            self.state = step(states, self.state, b);
            if let Some(index) = states[self.state as usize].output {
                // A stop string ends with a whole character, so `i + 1` is a boundary of `delta`.
                self.held.push_str(&delta[..=i]);
                let start = self.held.len() - self.automaton.stops[index as usize].len();
                let text = self.held[..start].to_string();
                self.held.clear();
                self.stopped = Some(index as usize);
                return StopCheck::Stopped { text, index: index as usize };
            }
        }
        self.held.push_str(delta);
        // Release all but the part that may still begin a stop string, keeping characters whole.
        let keep = (states[self.state as usize].depth as usize).min(self.held.len());
        let mut cut = self.held.len() - keep;
        while !self.held.is_char_boundary(cut) {
            cut -= 1;
        }
        let text = self.held[..cut].to_string();
        self.held.replace_range(..cut, "");
        StopCheck::Continue { text }
    }

    /// Releases held text when generation ends for another reason (EOS, length): it never
    /// completed a stop string, so it belongs to the output.
    pub fn finish(&mut self) -> String {
        if self.stopped.is_some() {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Failure-link steps taken to feed `text` byte by byte: the work `push` does.
    fn transitions(automaton: &StopAutomaton, text: &[u8]) -> usize {
        let (mut at, mut work) = (ROOT, 0);
        for &b in text {
            loop {
                work += 1;
                if let Some(next) = edge(&automaton.states[at as usize], b) {
                    at = next;
                    break;
                }
                if at == ROOT {
                    break;
                }
                at = automaton.states[at as usize].fail;
            }
        }
        work
    }

    #[test]
    fn work_per_byte_is_bounded_for_adversarial_stop_strings() {
        // 64 stop strings of 1024 bytes that all almost match a long run of one letter: the
        // old matcher searched each of them in the held text at every delta.
        let stops: Vec<String> = (0..64).map(|k| "a".repeat(1000 + k) + &"b".repeat(24 - k % 24 + 1)).collect();
        let automaton = StopAutomaton::new(stops).unwrap();
        let text = "a".repeat(100_000);
        assert!(transitions(&automaton, text.as_bytes()) <= 2 * text.len());
        let mixed = "ab".repeat(50_000);
        assert!(transitions(&automaton, mixed.as_bytes()) <= 2 * mixed.len());
    }

    #[test]
    fn held_text_is_never_longer_than_the_longest_stop() {
        let mut m = StopMatcher::new(vec!["a".repeat(1024) + "b"]).unwrap();
        for _ in 0..5000 {
            assert!(matches!(m.push("a"), StopCheck::Continue { .. }));
            assert!(m.held.len() <= 1024);
        }
    }

    #[test]
    fn sixty_four_long_stops_compile_to_a_small_automaton() {
        let stops: Vec<String> = (0..64).map(|k| format!("{k:04}") + &"x".repeat(1020)).collect();
        let automaton = StopAutomaton::new(stops).unwrap();
        assert!(automaton.states.len() <= 64 * 1024 + 1);
    }
}
