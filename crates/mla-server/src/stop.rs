//! Stop strings on streamed text.
//!
//! Text arrives in detokenizer deltas, and a stop string can span several of them. Text that
//! could still be the beginning of a stop string is held back until the next delta decides; text
//! that cannot is released at once. On a match the text before the stop string is released, the
//! stop string itself is not (OpenAI semantics), and the caller ends the request.
//!
//! When several stop strings match, the one that is completed first in the text wins (the point
//! where a token-by-token check would have stopped); if two complete at the same character, the
//! longer one, which starts earlier, wins.

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

#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released.
    held: String,
    /// Index of the stop string that matched, once one has.
    stopped: Option<usize>,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Result<Self, EmptyStopString> {
        if stops.iter().any(String::is_empty) {
            return Err(EmptyStopString);
        }
        Ok(Self { stops, held: String::new(), stopped: None })
    }

    pub fn stop_strings(&self) -> &[String] {
        &self.stops
    }

    /// Feeds the next delta. After a `Stopped` result every further delta is ignored (`Stopped`
    /// again with empty text), so a caller that keeps feeding cannot leak text past the stop.
    pub fn push(&mut self, delta: &str) -> StopCheck {
        if let Some(index) = self.stopped {
            return StopCheck::Stopped { text: String::new(), index };
        }
        self.held.push_str(delta);
        if let Some((start, index)) = self.first_match() {
            self.stopped = Some(index);
            let text = self.held[..start].to_string();
            self.held.clear();
            return StopCheck::Stopped { text, index };
        }
        let keep = self.longest_partial_suffix();
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.replace_range(..self.held.len() - keep, "");
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

    /// (byte start, stop index) of the stop string completed earliest in `held`.
    fn first_match(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(index, stop)| self.held.find(stop.as_str()).map(|start| (start + stop.len(), start, index)))
            .min_by_key(|&(end, start, index)| (end, start, index))
            .map(|(_, start, index)| (start, index))
    }

    /// Length in bytes of the longest suffix of `held` that is a proper prefix of a stop string.
    fn longest_partial_suffix(&self) -> usize {
        let longest_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        let min_start = self.held.len().saturating_sub(longest_stop.saturating_sub(1));
        (min_start..self.held.len())
            .filter(|&start| self.held.is_char_boundary(start))
            .find(|&start| {
                let suffix = &self.held[start..];
                self.stops.iter().any(|stop| stop.len() > suffix.len() && stop.starts_with(suffix))
            })
            .map(|start| self.held.len() - start)
            .unwrap_or(0)
    }
}
