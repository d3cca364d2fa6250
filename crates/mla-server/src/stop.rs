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
/// `State::output` of a state where no stop string ends.
const NO_OUTPUT: u32 = u32::MAX;

/// One automaton state: 16 bytes, plus 5 bytes per trie edge in the automaton's shared edge
/// arrays, so the 64K states of 64 stop strings of 1024 bytes take about 1.4 MB, in a handful of
/// allocations (the automaton is dropped on an async worker when the request ends).
#[derive(Debug, Clone, Copy)]
struct State {
    /// Index of this state's first edge in `edge_bytes`/`edge_targets`; its edges end where the
    /// next state's begin. Sorted by byte for binary search.
    first_edge: u32,
    /// The state of the longest proper suffix of this state's string that is also in the trie.
    fail: u32,
    /// Length in bytes of this state's string.
    depth: u32,
    /// The stop string that ends here and wins the tie rules: the longest one that is a suffix
    /// of this state's string, the lowest index among equal strings; or `NO_OUTPUT`.
    output: u32,
}

/// The stop strings of one request, compiled; immutable and shared by its completions.
#[derive(Debug)]
pub struct StopAutomaton {
    stops: Vec<String>,
    states: Vec<State>,
    edge_bytes: Vec<u8>,
    edge_targets: Vec<u32>,
    /// The root's transitions as a table (`ROOT` where it has no edge): ordinary text keeps
    /// falling back to the root, so most bytes cost one lookup here.
    root: [u32; 256],
}

impl StopAutomaton {
    /// Costs time and memory linear in the stops' total length (up to 64K states): build it off
    /// the async runtime.
    pub fn new(stops: Vec<String>) -> Result<Self, EmptyStopString> {
        if stops.iter().any(String::is_empty) {
            return Err(EmptyStopString);
        }
        // The trie with an edge list per state, flattened below into the shared arrays.
        let total: usize = stops.iter().map(String::len).sum();
        let mut trie: Vec<Vec<(u8, u32)>> = Vec::with_capacity(total + 1);
        trie.push(Vec::new());
        let mut states = Vec::with_capacity(total + 1);
        states.push(State { first_edge: 0, fail: ROOT, depth: 0, output: NO_OUTPUT });
        for (index, stop) in stops.iter().enumerate() {
            let mut at = ROOT;
            for &b in stop.as_bytes() {
                let edges = &trie[at as usize];
                at = match edges.binary_search_by_key(&b, |&(e, _)| e) {
                    Ok(k) => edges[k].1,
                    Err(slot) => {
                        let next = trie.len() as u32;
                        let depth = states[at as usize].depth + 1;
                        trie[at as usize].insert(slot, (b, next));
                        trie.push(Vec::new());
                        states.push(State { first_edge: 0, fail: ROOT, depth, output: NO_OUTPUT });
                        next
                    }
                };
            }
            // A repeated stop string keeps its first index.
            let output = &mut states[at as usize].output;
            if *output == NO_OUTPUT {
                *output = index as u32;
            }
        }
        let mut automaton = StopAutomaton {
            stops,
            states,
            edge_bytes: Vec::with_capacity(total),
            edge_targets: Vec::with_capacity(total),
            root: [ROOT; 256],
        };
        for (at, edges) in trie.iter().enumerate() {
            automaton.states[at].first_edge = automaton.edge_bytes.len() as u32;
            automaton.edge_bytes.extend(edges.iter().map(|&(b, _)| b));
            automaton.edge_targets.extend(edges.iter().map(|&(_, next)| next));
        }
        for &(b, next) in &trie[ROOT as usize] {
            automaton.root[b as usize] = next;
        }
        automaton.link(&trie);
        Ok(automaton)
    }

    /// Failure links and outputs, breadth first: a state's link is shallower than the state, so
    /// it is final before the state's children follow it.
    fn link(&mut self, trie: &[Vec<(u8, u32)>]) {
        let mut queue = std::collections::VecDeque::from([ROOT]);
        while let Some(at) = queue.pop_front() {
            for &(b, child) in &trie[at as usize] {
                let fail = if at == ROOT { ROOT } else { self.step(self.states[at as usize].fail, b, &mut 0) };
                let inherited = self.states[fail as usize].output;
                let state = &mut self.states[child as usize];
                state.fail = fail;
                // Its own stop string, if any, is longer than any reached through the link.
                if state.output == NO_OUTPUT {
                    state.output = inherited;
                }
                queue.push_back(child);
            }
        }
    }

    pub fn stop_strings(&self) -> &[String] {
        &self.stops
    }

    fn edge(&self, at: u32, b: u8) -> Option<u32> {
        let start = self.states[at as usize].first_edge as usize;
        let end = self.states.get(at as usize + 1).map_or(self.edge_bytes.len(), |s| s.first_edge as usize);
        let k = self.edge_bytes[start..end].binary_search(&b).ok()?;
        Some(self.edge_targets[start + k])
    }

    /// The state after reading `b` in state `at`: follow failure links until an edge takes `b`.
    /// Adds the edge lookups to `work`: one per byte plus one per link followed, and each link
    /// lowers the depth that each byte raises by at most one, so at most two per byte in all.
    fn step(&self, mut at: u32, b: u8, work: &mut usize) -> u32 {
        loop {
            *work += 1;
            if at == ROOT {
                return self.root[b as usize];
            }
            if let Some(next) = self.edge(at, b) {
                return next;
            }
            at = self.states[at as usize].fail;
        }
    }
}

/// One completion's matching state over a shared automaton; cloning one starts another
/// completion at the same point.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    automaton: Arc<StopAutomaton>,
    state: u32,
    /// Text received but not yet released: the automaton state's string.
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
        self.push_counting(delta).0
    }

    /// `push`, also returning the automaton's edge lookups: the work, which tests bound.
    fn push_counting(&mut self, delta: &str) -> (StopCheck, usize) {
        let mut work = 0;
        if let Some(index) = self.stopped {
            return (StopCheck::Stopped { text: String::new(), index }, work);
        }
        let automaton = &*self.automaton;
        for (i, &b) in delta.as_bytes().iter().enumerate() {
            self.state = automaton.step(self.state, b, &mut work);
            let index = automaton.states[self.state as usize].output;
            if index != NO_OUTPUT {
                // The first byte with an output ends the earliest-completed stop string, and the
                // output is the one the tie rules pick there. A stop string ends with a whole
                // character, so `i + 1` is a boundary of `delta`.
                let index = index as usize;
                self.held.push_str(&delta[..=i]);
                let start = self.held.len() - automaton.stops[index].len();
                let text = self.held[..start].to_string();
                self.held.clear();
                self.stopped = Some(index);
                return (StopCheck::Stopped { text, index }, work);
            }
        }
        self.held.push_str(delta);
        // Release all but the state's string: the longest suffix that may still begin a stop
        // string. That string begins with the first byte of a stop string, so on a character
        // boundary; walking down to one only guards the slice.
        let keep = (automaton.states[self.state as usize].depth as usize).min(self.held.len());
        let mut cut = self.held.len() - keep;
        while !self.held.is_char_boundary(cut) {
            cut -= 1;
        }
        let text = self.held[..cut].to_string();
        self.held.replace_range(..cut, "");
        (StopCheck::Continue { text }, work)
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

    /// Feeds `text` one character per delta; returns the released text and the work done.
    fn feed_by_char(m: &mut StopMatcher, text: &str) -> (String, usize) {
        let (mut released, mut work) = (String::new(), 0);
        for c in text.chars() {
            match m.push_counting(c.encode_utf8(&mut [0; 4])) {
                (StopCheck::Continue { text }, w) => {
                    released.push_str(&text);
                    work += w;
                }
                (stopped, _) => panic!("no stop string occurs in the text, got {stopped:?}"),
            }
        }
        (released, work)
    }

    #[test]
    fn work_per_byte_is_bounded_for_adversarial_stop_strings() {
        // 64 stop strings of 1024 bytes that all almost match a long run of one letter: the old
        // matcher searched each of them in the held text (1023 bytes here) at every delta.
        let stops: Vec<String> = (0..64).map(|k| "a".repeat(1023 - k) + "b" + &"a".repeat(k)).collect();
        assert!(stops.iter().all(|s| s.len() == 1024));
        let automaton = Arc::new(StopAutomaton::new(stops).unwrap());

        let text = "a".repeat(100_000);
        let mut m = StopMatcher::shared(automaton.clone());
        let (released, work) = feed_by_char(&mut m, &text);
        assert!(work <= 2 * text.len(), "{work} edge lookups for {} bytes", text.len());
        assert_eq!(released.len(), text.len() - 1023, "all but the longest possible stop prefix");
        assert_eq!(released.len() + m.finish().len(), text.len());

        // Falling from depth 1023 back to the root follows 1023 links in one byte: amortised
        // over the bytes that climbed there, still two lookups per byte.
        let text = ("a".repeat(1023) + "c").repeat(100);
        let mut m = StopMatcher::shared(automaton);
        let (released, work) = feed_by_char(&mut m, &text);
        assert!(work <= 2 * text.len(), "{work} edge lookups for {} bytes", text.len());
        assert_eq!(released, text);
    }

    #[test]
    fn held_text_is_never_longer_than_the_longest_stop() {
        let mut m = StopMatcher::new(vec!["a".repeat(1023) + "b"]).unwrap();
        for _ in 0..5000 {
            assert!(matches!(m.push("a"), StopCheck::Continue { .. }));
            assert!(m.held.len() < 1024);
        }
    }

    #[test]
    fn sixty_four_long_stops_compile_to_a_small_automaton() {
        // Almost no shared prefixes: close to one state per byte, the most a request can ask for.
        let stops: Vec<String> = (0..64).map(|k| format!("{k:04}") + &"é".repeat(510)).collect();
        let automaton = StopAutomaton::new(stops).unwrap();
        // The root, "0" and "00", "000" to "006", the 64 prefixes, then 1020 bytes of each.
        assert_eq!(automaton.states.len(), 1 + 2 + 7 + 64 + 64 * 1020);
        let bytes = automaton.states.capacity() * std::mem::size_of::<State>()
            + automaton.edge_bytes.capacity()
            + automaton.edge_targets.capacity() * std::mem::size_of::<u32>()
            + automaton.stops.iter().map(String::capacity).sum::<usize>()
            + std::mem::size_of::<StopAutomaton>();
        assert!(bytes <= 2 << 20, "{bytes} bytes");
    }
}
