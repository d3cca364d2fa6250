//! Reading structure out of generated chat text: DeepSeek-R1's reasoning block
//! (`--reasoning-parser`) and DeepSeek's native tool calls (`--tool-call-parser`).
//!
//! This is server-side text work on what the detokenizer and the stop matcher release (the text
//! the client would get without parsing); the engine never sees it. Parsers are incremental:
//! streaming feeds them each delta, a non-streamed response feeds them the whole text, and both
//! give the same result for any split of the text (the fixture tests check every split). The
//! reasoning parser runs first; tool calls are parsed in its content part only, since R1-0528
//! thinks first and then calls tools.
//!
//! The tool-call markers are ordinary added tokens in DeepSeek's tokenizers (`special: false`),
//! so `skip_special_tokens` keeps them in the decoded text and the parser sees them; clients get
//! them only as structured `tool_calls`.

pub mod deepseek_v3;
pub mod grammar;
mod partial;
pub mod reasoning;

use deepseek_v3::{DeepSeekToolParser, ToolCallDelta, ToolFormat};
use reasoning::DeepSeekR1Reasoning;

/// `--reasoning-parser` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParserKind {
    DeepSeekR1,
}

impl ReasoningParserKind {
    pub const NAMES: [&'static str; 1] = ["deepseek_r1"];

    /// vLLM's names; `-` and `_` are interchangeable (`deepseek-r1`).
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name.replace('-', "_").as_str() {
            "deepseek_r1" => Ok(Self::DeepSeekR1),
            _ => Err(format!("unknown reasoning parser \"{name}\" (known: {})", Self::NAMES.join(", "))),
        }
    }
}

/// `--tool-call-parser` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolParserKind {
    /// DeepSeek-V3 / V3-0324 / R1 / R1-0528 (vLLM's `deepseek_v3`).
    DeepSeekV3,
    /// DeepSeek-V3.1 (vLLM's `deepseek_v31`).
    DeepSeekV31,
}

impl ToolParserKind {
    pub const NAMES: [&'static str; 2] = ["deepseek_v3", "deepseek_v31"];

    pub fn from_name(name: &str) -> Result<Self, String> {
        match name.replace('-', "_").as_str() {
            "deepseek_v3" => Ok(Self::DeepSeekV3),
            "deepseek_v31" => Ok(Self::DeepSeekV31),
            _ => Err(format!("unknown tool call parser \"{name}\" (known: {})", Self::NAMES.join(", "))),
        }
    }

    fn format(self) -> ToolFormat {
        match self {
            Self::DeepSeekV3 => ToolFormat::V3,
            Self::DeepSeekV31 => ToolFormat::V31,
        }
    }
}

/// The server's parser flags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ParserConfig {
    pub reasoning: Option<ReasoningParserKind>,
    pub tool_call: Option<ToolParserKind>,
    /// `--enable-auto-tool-choice`: `tool_choice: "auto"` parses tool calls out of the reply.
    pub enable_auto_tool_choice: bool,
}

/// What one request's replies go through.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputParsing {
    pub reasoning: Option<ReasoningParserKind>,
    /// The tool format, and how many calls to report (`parallel_tool_calls: false`: 1).
    pub tools: Option<(ToolParserKind, Option<usize>)>,
}

impl OutputParsing {
    pub fn is_active(&self) -> bool {
        self.reasoning.is_some() || self.tools.is_some()
    }

    pub fn choice_parser(&self) -> ChoiceParser {
        ChoiceParser {
            reasoning: self.reasoning.map(|ReasoningParserKind::DeepSeekR1| DeepSeekR1Reasoning::default()),
            tools: self.tools.map(|(kind, max)| DeepSeekToolParser::new(kind.format(), max)),
        }
    }
}

/// New parsed output of one choice, in reply order: reasoning, content, call pieces.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedDelta {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCallDelta>,
}

impl ParsedDelta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.tool_calls.is_empty()
    }

    pub fn append(&mut self, other: ParsedDelta) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self.tool_calls.extend(other.tool_calls);
    }
}

/// The parser state of one choice.
#[derive(Debug, Clone)]
pub struct ChoiceParser {
    reasoning: Option<DeepSeekR1Reasoning>,
    tools: Option<DeepSeekToolParser>,
}

impl ChoiceParser {
    pub fn push(&mut self, text: &str) -> ParsedDelta {
        let (reasoning, content) = match &mut self.reasoning {
            Some(r) => {
                let s = r.push(text);
                (s.reasoning, s.content)
            }
            None => (String::new(), text.to_string()),
        };
        self.content(reasoning, &content)
    }

    /// Ends the reply: releases everything held back.
    pub fn finish(&mut self) -> ParsedDelta {
        let (reasoning, content) = match &mut self.reasoning {
            Some(r) => {
                let s = r.finish();
                (s.reasoning, s.content)
            }
            None => (String::new(), String::new()),
        };
        let mut out = self.content(reasoning, &content);
        if let Some(t) = &mut self.tools {
            let s = t.finish();
            out.append(ParsedDelta { reasoning: String::new(), content: s.content, tool_calls: s.calls });
        }
        out
    }

    /// Whether any tool call was reported (`finish_reason: "tool_calls"`).
    pub fn called_tools(&self) -> bool {
        self.tools.as_ref().is_some_and(|t| t.reported_calls() > 0)
    }

    fn content(&mut self, reasoning: String, content: &str) -> ParsedDelta {
        match &mut self.tools {
            Some(t) => {
                let s = t.push(content);
                ParsedDelta { reasoning, content: s.content, tool_calls: s.calls }
            }
            None => ParsedDelta { reasoning, content: content.to_string(), tool_calls: vec![] },
        }
    }
}

/// A whole reply, assembled from its deltas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedMessage {
    pub reasoning: String,
    pub content: String,
    /// (name, arguments) per call, in order.
    pub tool_calls: Vec<(String, String)>,
}

impl ParsedMessage {
    pub fn absorb(&mut self, d: ParsedDelta) {
        self.reasoning.push_str(&d.reasoning);
        self.content.push_str(&d.content);
        for call in d.tool_calls {
            if let Some(name) = call.name {
                self.tool_calls.push((name, String::new()));
            }
            if let Some((_, args)) = self.tool_calls.get_mut(call.index) {
                args.push_str(&call.arguments);
            }
        }
    }

    /// Parses a whole reply at once.
    pub fn parse(parsing: &OutputParsing, text: &str) -> Self {
        let mut parser = parsing.choice_parser();
        let mut message = ParsedMessage::default();
        message.absorb(parser.push(text));
        message.absorb(parser.finish());
        message
    }
}

impl ParserConfig {
    /// The markers the configured parsers look for that this tokenizer would not hand them:
    /// a marker the tokenizer treats as a special token is dropped by `skip_special_tokens`
    /// decoding (the default), so the parser could never see it. DeepSeek's own tokenizers keep
    /// them (their `special` flag is false); a converted or custom tokenizer might not.
    pub fn hidden_markers(&self, tokenizer: &crate::tokenizer::TextTokenizer) -> Vec<&'static str> {
        let mut markers = vec![];
        if self.reasoning.is_some() {
            markers.extend([reasoning::THINK_START, reasoning::THINK_END]);
        }
        if self.tool_call.is_some() {
            use deepseek_v3::*;
            markers.extend([CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP]);
        }
        markers
            .into_iter()
            .filter(|m| {
                let decoded = tokenizer.encode(m, false).and_then(|ids| tokenizer.decode(&ids, true));
                decoded.ok().as_deref() != Some(*m)
            })
            .collect()
    }
}

/// A fresh OpenAI-style tool call id (`call_` and 24 hex digits).
pub fn tool_call_id() -> String {
    format!("call_{:024x}", rand::random::<u128>() >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_vllms_and_unknown_ones_list_the_known() {
        assert_eq!(ReasoningParserKind::from_name("deepseek-r1"), Ok(ReasoningParserKind::DeepSeekR1));
        assert_eq!(ReasoningParserKind::from_name("deepseek_r1"), Ok(ReasoningParserKind::DeepSeekR1));
        assert!(ReasoningParserKind::from_name("qwen3").unwrap_err().contains("deepseek_r1"));
        assert_eq!(ToolParserKind::from_name("deepseek_v31"), Ok(ToolParserKind::DeepSeekV31));
        assert!(ToolParserKind::from_name("hermes").unwrap_err().contains("deepseek_v3, deepseek_v31"));
    }

    #[test]
    fn reasoning_then_tool_calls() {
        let parsing = OutputParsing {
            reasoning: Some(ReasoningParserKind::DeepSeekR1),
            tools: Some((ToolParserKind::DeepSeekV3, None)),
        };
        // A call inside the thinking block is thought, not a call.
        let text = "plan <｜tool▁calls▁begin｜></think>\n\nOk.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let m = ParsedMessage::parse(&parsing, text);
        assert_eq!(m.reasoning, "plan <｜tool▁calls▁begin｜>");
        assert_eq!(m.content, "\n\nOk.");
        assert_eq!(m.tool_calls, vec![("f".to_string(), "{}".to_string())]);
        assert!(tool_call_id().starts_with("call_") && tool_call_id().len() == 29);
    }
}
