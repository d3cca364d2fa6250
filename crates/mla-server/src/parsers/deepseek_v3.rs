//! DeepSeek's native tool-call format, parsed incrementally.
//!
//! V3 / R1 (the format their chat templates render for assistant `tool_calls`, and what vLLM's
//! `deepseek_v3` parser reads):
//!
//! ```text
//! CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
//! ```json
//! ARGS
//! ```<｜tool▁call▁end｜>
//! <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>
//! ```
//!
//! V3.1 (vLLM's `deepseek_v31`) drops the type and the fence:
//! `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`.
//!
//! The parser emits a call's name as soon as its header is complete and then its arguments in
//! pieces, holding back only a tail that could still become the closing fence or marker, so a
//! streamed reply never shows marker text and the pieces add up to the non-streamed result.
//! Differences from vLLM, on purpose:
//! - the fences are matched leniently (an opening "```" with any or no language tag, or none;
//!   any whitespace around an optional closing "```"), where vLLM's regex demands exactly
//!   "```json\n" and "\n```" and otherwise returns the whole reply as content;
//! - text after `<｜tool▁calls▁end｜>` (or anything that is not a call between calls) stays
//!   `content` instead of being dropped;
//! - a call cut off inside its arguments (length limit) is still reported, with the arguments
//!   generated so far, so the client sees what the model did; `finish_reason` stays `length`.

use super::partial::partial_marker_len;

pub const CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
pub const CALLS_END: &str = "<｜tool▁calls▁end｜>";
pub const CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
pub const CALL_END: &str = "<｜tool▁call▁end｜>";
pub const SEP: &str = "<｜tool▁sep｜>";
const FENCE: &str = "```";

/// Which DeepSeek generation wrote the calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `function<｜tool▁sep｜>NAME\n```json\nARGS\n```` (V3, V3-0324, R1, R1-0528).
    V3,
    /// `NAME<｜tool▁sep｜>ARGS` (V3.1).
    V31,
}

/// A piece of a tool call: the first piece of each call carries its `name` (and empty arguments),
/// later pieces carry argument text; `index` counts calls from 0 in the order they appear.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallDelta {
    pub index: usize,
    pub name: Option<String>,
    pub arguments: String,
}

/// One step's output: content text, then call pieces (a step that ends the content part and
/// starts calls has both; content text always precedes the calls in the reply).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolSplit {
    pub content: String,
    pub calls: Vec<ToolCallDelta>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Content,
    /// Inside the calls block, before a call or the block's end.
    BetweenCalls,
    Header,
    Arguments,
    AfterCalls,
}

#[derive(Debug, Clone)]
pub struct DeepSeekToolParser {
    format: ToolFormat,
    state: State,
    held: String,
    /// Calls whose header was seen (the next call's index).
    calls: usize,
    /// `parallel_tool_calls: false`: calls after the first are parsed but not reported.
    max_calls: Option<usize>,
}

impl DeepSeekToolParser {
    pub fn new(format: ToolFormat, max_calls: Option<usize>) -> Self {
        Self { format, state: State::Content, held: String::new(), calls: 0, max_calls }
    }

    /// Calls reported so far.
    pub fn reported_calls(&self) -> usize {
        self.max_calls.map_or(self.calls, |m| self.calls.min(m))
    }

    fn reporting(&self, index: usize) -> bool {
        self.max_calls.is_none_or(|m| index < m)
    }

    pub fn push(&mut self, text: &str) -> ToolSplit {
        self.held.push_str(text);
        let mut out = ToolSplit::default();
        while self.step(&mut out) {}
        out
    }

    /// Ends the reply. Held text is a possible marker or fence prefix, except in an unfinished
    /// call header, which was never reported: that goes back to content.
    pub fn finish(&mut self) -> ToolSplit {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Content | State::AfterCalls | State::Header => ToolSplit { content: held, calls: vec![] },
            State::BetweenCalls | State::Arguments => ToolSplit::default(),
        }
    }

    /// Advances over `held` once; false when it must wait for more text.
    fn step(&mut self, out: &mut ToolSplit) -> bool {
        match self.state {
            State::AfterCalls => {
                out.content.push_str(&self.held);
                self.held.clear();
                false
            }
            State::Content => {
                if let Some(at) = self.held.find(CALLS_BEGIN) {
                    out.content.push_str(&self.held[..at]);
                    self.held.drain(..at + CALLS_BEGIN.len());
                    self.state = State::BetweenCalls;
                    return true;
                }
                let release = self.held.len() - partial_marker_len(&self.held, CALLS_BEGIN);
                out.content.push_str(&self.held[..release]);
                self.held.drain(..release);
                false
            }
            State::BetweenCalls => {
                let trimmed = self.held.trim_start();
                if let Some(rest) = trimmed.strip_prefix(CALL_BEGIN) {
                    self.held = rest.to_string();
                    self.state = State::Header;
                    true
                } else if let Some(rest) = trimmed.strip_prefix(CALLS_END) {
                    self.held = rest.to_string();
                    self.state = State::AfterCalls;
                    true
                } else if CALL_BEGIN.starts_with(trimmed) || CALLS_END.starts_with(trimmed) {
                    false
                } else {
                    // Not a call: the block ended without its marker; the rest is content.
                    self.state = State::AfterCalls;
                    true
                }
            }
            State::Header => self.header(out),
            State::Arguments => self.arguments(out),
        }
    }

    /// Waits for the whole header, then reports the call's name. A header not complete within
    /// `MAX_HEADER` bytes is not one (the model went off format): the text goes back to content
    /// instead of being held to the end. Only the first `MAX_HEADER` bytes are ever looked at,
    /// so a streamed reply decides as the whole reply does.
    fn header(&mut self, out: &mut ToolSplit) -> bool {
        let mut view = self.held.len().min(MAX_HEADER);
        while !self.held.is_char_boundary(view) {
            view -= 1;
        }
        let Some((name, args_at)) = header_end(self.format, &self.held[..view]) else {
            if self.held.len() > MAX_HEADER {
                self.state = State::AfterCalls;
                return true;
            }
            return false;
        };
        let index = self.calls;
        self.calls += 1;
        if self.reporting(index) {
            out.calls.push(ToolCallDelta { index, name: Some(name), arguments: String::new() });
        }
        self.held.drain(..args_at);
        self.state = State::Arguments;
        true
    }

    /// Releases argument text up to a possible closing (fence and) marker.
    fn arguments(&mut self, out: &mut ToolSplit) -> bool {
        let index = self.calls - 1;
        let (release, consumed, done) = match self.held.find(CALL_END) {
            Some(at) => {
                let args = match self.format {
                    ToolFormat::V3 => strip_closing_fence(&self.held[..at]),
                    ToolFormat::V31 => &self.held[..at],
                };
                (args.len(), at + CALL_END.len(), true)
            }
            None => {
                let keep = match self.format {
                    ToolFormat::V3 => partial_closing_len(&self.held),
                    ToolFormat::V31 => partial_marker_len(&self.held, CALL_END),
                };
                let release = self.held.len() - keep;
                (release, release, false)
            }
        };
        if release > 0 && self.reporting(index) {
            out.calls.push(ToolCallDelta { index, name: None, arguments: self.held[..release].to_string() });
        }
        self.held.drain(..consumed);
        if done {
            self.state = State::BetweenCalls;
        }
        done
    }
}

/// Longest call header looked for: type, separator, name (OpenAI caps names at 64 characters)
/// and fence line fit many times over.
const MAX_HEADER: usize = 512;

/// The call's name and where its arguments start, once `text` holds the whole header.
fn header_end(format: ToolFormat, text: &str) -> Option<(String, usize)> {
    let sep = text.find(SEP)?;
    match format {
        ToolFormat::V31 => Some((text[..sep].trim().to_string(), sep + SEP.len())),
        ToolFormat::V3 => {
            let after = sep + SEP.len();
            let nl = text[after..].find('\n')?;
            let body = after + nl + 1;
            let fence = opening_fence_len(&text[body..])?;
            Some((text[after..after + nl].trim().to_string(), body + fence))
        }
    }
}

/// Bytes of the fence line opening the arguments ("```json\n", or "```" with another or no
/// language tag), 0 when the arguments start without one, `None` while it cannot be told yet.
fn opening_fence_len(rest: &str) -> Option<usize> {
    const MAX_TAG: usize = 16;
    if rest.len() < FENCE.len() {
        return if FENCE.starts_with(rest) { None } else { Some(0) };
    }
    if !rest.starts_with(FENCE) {
        return Some(0);
    }
    for (i, c) in rest[FENCE.len()..].char_indices() {
        match c {
            '\n' => return Some(FENCE.len() + i + 1),
            c if c.is_ascii_alphanumeric() && i < MAX_TAG => {}
            _ => return Some(0), // not a fence line: the backticks are argument text
        }
    }
    None
}

/// The arguments before `\s*(```)?\s*` at their end.
fn strip_closing_fence(args: &str) -> &str {
    let t = args.trim_end();
    t.strip_suffix(FENCE).map_or(t, str::trim_end)
}

/// Whether `t` can still grow into `\s*(```)?\s*<｜tool▁call▁end｜>`.
fn is_closing_prefix(t: &str) -> bool {
    let t = t.trim_start();
    let t = match t.strip_prefix(FENCE) {
        Some(rest) => rest.trim_start(),
        None if FENCE.starts_with(t) => return true,
        None => t,
    };
    CALL_END.starts_with(t)
}

/// Bytes at the end of `args` that may be the start of the closing fence and marker. Only a
/// tail of whitespace, backticks and marker characters can be, so the search starts there.
fn partial_closing_len(args: &str) -> usize {
    let may_close = |c: char| c.is_whitespace() || c == '`' || CALL_END.contains(c);
    let tail_start = args.char_indices().rev().find(|&(_, c)| !may_close(c)).map_or(0, |(i, c)| i + c.len_utf8());
    args[tail_start..]
        .char_indices()
        .map(|(i, _)| tail_start + i)
        .find(|&i| is_closing_prefix(&args[i..]))
        .map_or(0, |i| args.len() - i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(format: ToolFormat, text: &str) -> (String, Vec<(String, String)>) {
        let mut p = DeepSeekToolParser::new(format, None);
        let mut a = p.push(text);
        let b = p.finish();
        a.content.push_str(&b.content);
        a.calls.extend(b.calls);
        let mut calls: Vec<(String, String)> = vec![];
        for d in a.calls {
            if let Some(name) = d.name {
                calls.push((name, String::new()));
            }
            calls[d.index].1.push_str(&d.arguments);
        }
        (a.content, calls)
    }

    #[test]
    fn v3_calls_and_content() {
        let text = "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (content, calls) = parse(ToolFormat::V3, text);
        assert_eq!(content, "Let me check.");
        assert_eq!(
            calls,
            vec![("get_weather".into(), "{\"city\": \"Paris\"}".into()), ("get_time".into(), "{}".into())]
        );
    }

    #[test]
    fn v31_calls() {
        let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert_eq!(
            parse(ToolFormat::V31, text),
            (String::new(), vec![("get_weather".into(), "{\"city\": \"Oslo\"}".into())])
        );
    }

    #[test]
    fn no_calls_is_all_content_and_partial_markers_are_released_at_the_end() {
        assert_eq!(parse(ToolFormat::V3, "plain <｜tool"), ("plain <｜tool".into(), vec![]));
    }

    #[test]
    fn backticks_inside_arguments_survive() {
        let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>run\n```json\n{\"code\": \"```py``` `x`\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert_eq!(parse(ToolFormat::V3, text).1, vec![("run".into(), "{\"code\": \"```py``` `x`\"}".into())]);
    }

    #[test]
    fn unfinished_header_goes_back_to_content_and_truncated_arguments_are_kept() {
        let (content, calls) = parse(ToolFormat::V3, "a<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁se");
        assert_eq!((content.as_str(), calls.len()), ("afunction<｜tool▁se", 0));
        let (_, calls) = parse(
            ToolFormat::V3,
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": \n``",
        );
        assert_eq!(calls, vec![("f".into(), "{\"a\":".into())]);
    }

    #[test]
    fn only_the_first_call_when_parallel_calls_are_off() {
        let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>b\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let mut p = DeepSeekToolParser::new(ToolFormat::V3, Some(1));
        let s = p.push(text);
        assert_eq!(s.calls.iter().filter(|d| d.name.is_some()).count(), 1);
        assert_eq!(p.reported_calls(), 1);
    }

    #[test]
    fn an_endless_header_is_content_whatever_the_split() {
        let text =
            format!("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function{}<｜tool▁sep｜>f\n{{}}", "x".repeat(600));
        let whole = parse(ToolFormat::V3, &text);
        assert_eq!(whole.1, vec![]);
        assert!(whole.0.starts_with("functionxxx") && whole.0.ends_with("<｜tool▁sep｜>f\n{}"));
        for (at, _) in text.char_indices().step_by(7) {
            let mut p = DeepSeekToolParser::new(ToolFormat::V3, None);
            let mut got = p.push(&text[..at]);
            for part in [p.push(&text[at..]), p.finish()] {
                got.content.push_str(&part.content);
                got.calls.extend(part.calls);
            }
            assert_eq!((got.content, got.calls.len()), (whole.0.clone(), 0), "split at {at}");
        }
    }

    #[test]
    fn opening_fences() {
        let call = |open: &str| {
            let text = format!("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{open}{{\"a\": 1}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>");
            parse(ToolFormat::V3, &text).1
        };
        let want = vec![("f".to_string(), "{\"a\": 1}".to_string())];
        assert_eq!(call("```json\n"), want);
        assert_eq!(call("```\n"), want);
        assert_eq!(call("```JSON5\n"), want);
        assert_eq!(call(""), want, "no fence at all");
        assert_eq!(opening_fence_len("``"), None);
        assert_eq!(opening_fence_len("```js"), None);
        assert_eq!(opening_fence_len("``x"), Some(0));
        assert_eq!(opening_fence_len("```js {"), Some(0));
        assert_eq!(opening_fence_len("{"), Some(0));
    }

    #[test]
    fn closing_prefixes() {
        assert_eq!(partial_closing_len("{\"a\": 1}\n``"), 3);
        assert_eq!(partial_closing_len("{\"a\": 1}\n```\n<｜tool▁ca"), "\n```\n<｜tool▁ca".len());
        assert_eq!(partial_closing_len("{\"a\": 1}"), 0);
        assert_eq!(partial_closing_len("{\"a\": \"x``` y"), 0);
        assert_eq!(strip_closing_fence("{}\n```\n"), "{}");
        assert_eq!(strip_closing_fence("{} "), "{}");
    }
}
