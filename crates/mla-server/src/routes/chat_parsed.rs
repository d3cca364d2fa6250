//! Chat replies through the output parsers (`parsers`): the assistant message of a finished
//! choice, and the stream deltas of a streaming one. Without parsers the chat route sends the
//! text as `content` unchanged; these are used only when a parser is active for the request.

use crate::parsers::{tool_call_id, ChoiceParser, OutputParsing, ParsedDelta, ParsedMessage};
use crate::protocol::chat::{AssistantMessage, Delta, FunctionCall, FunctionChunk, ToolCall, ToolCallChunk};
use mla_engine::FinishReason;

/// How a request wants the reasoning the parser splits off (`separate_reasoning: false` turns
/// the split off altogether, so it never gets here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReasoningReport {
    /// vLLM's `include_reasoning` (default true): false leaves it out.
    pub include: bool,
    /// SGLang's `stream_reasoning` (default true): false streams it as one delta, once the
    /// thinking block has ended (or the reply has).
    pub stream_pieces: bool,
}

impl Default for ReasoningReport {
    fn default() -> Self {
        ReasoningReport { include: true, stream_pieces: true }
    }
}

/// The message of a finished reply, and whether it called tools.
pub fn message(parsing: &OutputParsing, report: ReasoningReport, text: &str) -> (AssistantMessage, bool) {
    let parsed = ParsedMessage::parse(parsing, text);
    let called = !parsed.tool_calls.is_empty();
    let tool_calls = parsed
        .tool_calls
        .into_iter()
        .map(|(name, arguments)| ToolCall {
            id: tool_call_id(),
            kind: "function",
            function: FunctionCall { name, arguments },
        })
        .collect();
    let reasoning = (report.include && !parsed.reasoning.is_empty()).then_some(parsed.reasoning);
    let message = AssistantMessage {
        role: "assistant",
        content: (!parsed.content.is_empty()).then_some(parsed.content),
        reasoning: reasoning.clone(),
        reasoning_content: reasoning,
        tool_calls,
    };
    (message, called)
}

/// `finish_reason` with tool calls: a reply that stopped after calling tools finished with
/// `tool_calls`, as OpenAI reports it. A call cut off by the length limit keeps `length`, so the
/// client can tell its arguments are incomplete (vLLM reports `tool_calls` there too).
pub fn finish_reason(finish: FinishReason, called_tools: bool) -> &'static str {
    match finish {
        FinishReason::Stop if called_tools => "tool_calls",
        other => other.as_str(),
    }
}

/// One choice's parser while streaming.
pub struct StreamedChoice {
    parser: ChoiceParser,
    report: ReasoningReport,
    /// Reasoning held back until it is complete (`stream_pieces` false).
    held: String,
}

impl StreamedChoice {
    pub fn new(parsing: &OutputParsing, report: ReasoningReport) -> Self {
        Self { parser: parsing.choice_parser(), report, held: String::new() }
    }

    /// The deltas for new text (all of it, ending the reply when `last`), in reply order:
    /// reasoning, content, tool calls, each its own delta so that clients reading one field per
    /// chunk miss nothing. Also whether tool calls were reported so far.
    pub fn deltas(&mut self, text: &str, last: bool) -> (Vec<Delta>, bool) {
        let mut d = self.parser.push(text);
        if last {
            d.append(self.parser.finish());
        }
        if !self.report.include {
            d.reasoning.clear();
        } else if !self.report.stream_pieces {
            // The thinking block is complete once anything follows it, or the reply ends.
            self.held.push_str(&std::mem::take(&mut d.reasoning));
            let after = !d.content.is_empty() || !d.tool_calls.is_empty();
            if after || last {
                d.reasoning = std::mem::take(&mut self.held);
            }
        }
        (split(d), self.parser.called_tools())
    }
}

impl Delta {
    /// A delta carrying reasoning, under both of its names.
    fn reasoning(text: String) -> Delta {
        Delta { reasoning: Some(text.clone()), reasoning_content: Some(text), ..Default::default() }
    }
}

fn split(d: ParsedDelta) -> Vec<Delta> {
    let mut out = vec![];
    if !d.reasoning.is_empty() {
        out.push(Delta::reasoning(d.reasoning));
    }
    if !d.content.is_empty() {
        out.push(Delta { content: Some(d.content), ..Default::default() });
    }
    let mut calls: Vec<ToolCallChunk> = vec![];
    for piece in d.tool_calls {
        // A call's header and its first arguments in one update go out as one piece.
        match calls.last_mut() {
            Some(last) if last.index == piece.index && piece.name.is_none() => {
                last.function.arguments.push_str(&piece.arguments)
            }
            _ => {
                let first = piece.name.is_some();
                calls.push(ToolCallChunk {
                    index: piece.index,
                    id: first.then(tool_call_id),
                    kind: first.then_some("function"),
                    function: FunctionChunk { name: piece.name, arguments: piece.arguments },
                });
            }
        }
    }
    if !calls.is_empty() {
        out.push(Delta { tool_calls: Some(calls), ..Default::default() });
    }
    out
}
