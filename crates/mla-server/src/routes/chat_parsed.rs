//! Chat replies through the output parsers (`parsers`): the assistant message of a finished
//! choice, and the stream deltas of a streaming one. Without parsers the chat route sends the
//! text as `content` unchanged; these are used only when a parser is active for the request.

use crate::parsers::{tool_call_id, ChoiceParser, OutputParsing, ParsedDelta, ParsedMessage};
use crate::protocol::chat::{AssistantMessage, Delta, FunctionCall, FunctionChunk, ToolCall, ToolCallChunk};
use mla_engine::FinishReason;

/// The message of a finished reply, and whether it called tools.
pub fn message(parsing: &OutputParsing, text: &str) -> (AssistantMessage, bool) {
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
    let message = AssistantMessage {
        role: "assistant",
        content: (!parsed.content.is_empty()).then_some(parsed.content),
        reasoning_content: parsing.reasoning.is_some().then_some(parsed.reasoning),
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
}

impl StreamedChoice {
    pub fn new(parsing: &OutputParsing) -> Self {
        Self { parser: parsing.choice_parser() }
    }

    /// The deltas for new text (all of it, ending the reply when `last`), in reply order:
    /// reasoning, content, tool calls, each its own delta so that clients reading one field per
    /// chunk miss nothing. Also whether tool calls were reported so far.
    pub fn deltas(&mut self, text: &str, last: bool) -> (Vec<Delta>, bool) {
        let mut d = self.parser.push(text);
        if last {
            d.append(self.parser.finish());
        }
        (split(d), self.parser.called_tools())
    }
}

fn split(d: ParsedDelta) -> Vec<Delta> {
    let mut out = vec![];
    if !d.reasoning.is_empty() {
        out.push(Delta { reasoning_content: Some(d.reasoning), ..Default::default() });
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
