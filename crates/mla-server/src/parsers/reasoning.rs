//! DeepSeek-R1's reasoning format: the reply is `<think>REASONING</think>ANSWER`.
//!
//! R1's chat template (the 2025-01 revision and R1-0528) ends the prompt with `<｜Assistant｜><think>\n`,
//! so the reply usually starts inside the thinking block and only `</think>` appears; older
//! templates leave `<think>` to the model, so a leading `<think>` is dropped too. Like vLLM's
//! `deepseek_r1` parser, a reply without `</think>` is all reasoning (it was cut short while
//! thinking). Unlike vLLM, which partitions at the first `<think>` anywhere in the text and drops
//! what precedes it, only a `<think>` at the very start is removed: text before a later `<think>`
//! is model output and stays (as reasoning).
//!
//! The parser is incremental: `push` takes detokenized deltas as they stream and `finish` ends
//! the reply; pushing the whole text at once gives the same split as any sequence of pieces.

use super::partial::partial_marker_len;

pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";

/// One step's output: text for `reasoning_content` and for `content`, in that order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReasoningSplit {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing decided yet: the reply may open with `<think>`.
    Start,
    Thinking,
    Answer,
}

#[derive(Debug, Clone)]
pub struct DeepSeekR1Reasoning {
    phase: Phase,
    /// Text not yet released: a possible `<think>` / `</think>` prefix.
    held: String,
}

impl Default for DeepSeekR1Reasoning {
    fn default() -> Self {
        Self { phase: Phase::Start, held: String::new() }
    }
}

impl DeepSeekR1Reasoning {
    pub fn push(&mut self, text: &str) -> ReasoningSplit {
        self.held.push_str(text);
        let mut out = ReasoningSplit::default();
        loop {
            match self.phase {
                Phase::Start => {
                    if let Some(rest) = self.held.strip_prefix(THINK_START) {
                        self.held = rest.to_string();
                    } else if THINK_START.starts_with(self.held.as_str()) {
                        return out; // still could be `<think>` (or nothing yet)
                    }
                    self.phase = Phase::Thinking;
                }
                Phase::Thinking => {
                    if let Some(at) = self.held.find(THINK_END) {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + THINK_END.len());
                        self.phase = Phase::Answer;
                        continue;
                    }
                    let release = self.held.len() - partial_marker_len(&self.held, THINK_END);
                    out.reasoning.push_str(&self.held[..release]);
                    self.held.drain(..release);
                    return out;
                }
                Phase::Answer => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// Releases what was held: an unfinished tag is reasoning text like the rest of the block.
    pub fn finish(&mut self) -> ReasoningSplit {
        let held = std::mem::take(&mut self.held);
        match self.phase {
            Phase::Start | Phase::Thinking => ReasoningSplit { reasoning: held, content: String::new() },
            Phase::Answer => ReasoningSplit { reasoning: String::new(), content: held },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(text: &str) -> (String, String) {
        let mut p = DeepSeekR1Reasoning::default();
        let mut a = p.push(text);
        let b = p.finish();
        a.reasoning.push_str(&b.reasoning);
        a.content.push_str(&b.content);
        (a.reasoning, a.content)
    }

    #[test]
    fn splits_at_the_end_tag() {
        assert_eq!(whole("I think.\n</think>\n\nAnswer"), ("I think.\n".into(), "\n\nAnswer".into()));
        assert_eq!(whole("<think>\nhm</think>ok"), ("\nhm".into(), "ok".into()));
        // No end tag: cut off while thinking, everything is reasoning.
        assert_eq!(whole("<think>still going"), ("still going".into(), String::new()));
        assert_eq!(whole("</think>direct"), (String::new(), "direct".into()));
        // Only the first end tag splits; a second one is answer text.
        assert_eq!(whole("a</think>b</think>c"), ("a".into(), "b</think>c".into()));
        // A `<think>` not at the start is text.
        assert_eq!(whole("x<think>y</think>z"), ("x<think>y".into(), "z".into()));
        assert_eq!(whole("<thi"), ("<thi".into(), String::new()));
        assert_eq!(whole("r</thi"), ("r</thi".into(), String::new()));
        assert_eq!(whole(""), (String::new(), String::new()));
    }

    #[test]
    fn a_tag_split_over_deltas_is_held_not_leaked() {
        let mut p = DeepSeekR1Reasoning::default();
        assert_eq!(p.push("<th").reasoning, "");
        assert_eq!(p.push("ink>abc</").reasoning, "abc");
        let s = p.push("think>ans");
        assert_eq!((s.reasoning.as_str(), s.content.as_str()), ("", "ans"));
    }
}
