//! The text side of a request as the HTTP layer uses it: chat prompt rendering + tokenization,
//! completion prompts, per-choice incremental detokenization with stop strings, and token
//! pieces for logprobs. Built on `tokenizer`, `chat_template`, `detokenizer` and `stop`; this
//! module only turns their errors into `ApiError`s.

use crate::chat_template::{ChatTemplate, ChatTemplateError, RenderOptions};
use crate::content_special::{ContentGuard, Marked, Segment};
use crate::detokenizer::IncrementalDetokenizer;
use crate::error::ApiError;
use crate::prompt_size;
use crate::stop::{StopCheck, StopMatcher};
use crate::tokenizer::{TextTokenizer, TokenizerError};
use serde_json::{Map, Value};
use std::sync::Arc;

pub struct TextPipeline {
    tokenizer: TextTokenizer,
    /// `None` when the model has no chat template: chat requests are then refused (400).
    template: Option<ChatTemplate>,
    /// Keeps control-token text in message content plain text (`None`: no added tokens).
    guard: Option<ContentGuard>,
}

/// How a conversation becomes a prompt, besides its messages.
#[derive(Debug, Clone, Default)]
pub struct ChatPromptOptions {
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// Extra template variables (`chat_template_kwargs`).
    pub template_kwargs: Option<Map<String, Value>>,
    /// Control-token text in message content (and tools, kwargs) becomes control tokens (off by
    /// default; see `content_special`).
    pub content_special_tokens: bool,
    /// The request's tools, passed to the template as transformers' `apply_chat_template(tools=)`
    /// does (the published V3/R1 templates do not print them).
    pub tools: Option<Vec<Value>>,
}

impl ChatPromptOptions {
    /// The assistant prompt appended, nothing else: what a plain chat request renders.
    pub fn generation() -> Self {
        ChatPromptOptions { add_generation_prompt: true, ..Default::default() }
    }
}

impl TextPipeline {
    /// `template_override` (`--chat-template`) replaces the tokenizer_config.json template.
    pub fn new(tokenizer: TextTokenizer, template_override: Option<String>) -> anyhow::Result<Self> {
        let source = match template_override {
            Some(t) => Some(t),
            None => tokenizer.config().chat_templates.select(None, false).ok().map(str::to_string),
        };
        let template = source.map(|s| ChatTemplate::new(&s)).transpose()?;
        let guard = ContentGuard::new(tokenizer.protocol_token_texts());
        Ok(TextPipeline { tokenizer, template, guard })
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Renders the conversation and tokenizes it without adding special tokens: the template
    /// wrote BOS itself. A rendering clearly longer than `max_tokens` is refused before it is
    /// tokenized whole.
    pub fn chat_prompt(
        &self,
        messages: &[Value],
        max_tokens: usize,
        options: &ChatPromptOptions,
    ) -> Result<Vec<u32>, ApiError> {
        let template = self.template.as_ref().ok_or_else(|| {
            ApiError::invalid(
                "messages",
                "this model has no chat template; start the server with --chat-template FILE or use /v1/completions",
            )
        })?;
        let Marked { messages, tools, template_kwargs, marks } = match (&self.guard, options.content_special_tokens) {
            (Some(guard), false) => guard.mark(messages, options.tools.as_deref(), options.template_kwargs.as_ref()),
            _ => Marked {
                messages: messages.to_vec(),
                tools: options.tools.clone(),
                template_kwargs: options.template_kwargs.clone(),
                marks: None,
            },
        };
        let render = RenderOptions {
            add_generation_prompt: options.add_generation_prompt,
            continue_final_message: options.continue_final_message,
            special_tokens: self.tokenizer.template_special_tokens(),
            extra_variables: template_kwargs.as_ref(),
            tools: tools.as_deref(),
        };
        let rendered = template.render(&messages, &render).map_err(|e| match e {
            // The template refused the conversation, the messages are malformed, or rendering
            // failed on them (a template that compiled at start and renders ordinary turns fails
            // on what the request put in, e.g. `tool_calls` that are not a list of calls): the
            // client's error, as in vLLM.
            ChatTemplateError::Raised(_) | ChatTemplateError::InvalidMessages(_) => {
                ApiError::invalid("messages", e.to_string())
            }
            ChatTemplateError::Render(why) => ApiError::invalid(
                "messages",
                format!(
                    "the chat template cannot render these messages ({why}); check their fields, such as tool_calls"
                ),
            ),
            ChatTemplateError::Syntax(_) => ApiError::Internal(e.to_string()),
        })?;
        self.refuse_clearly_over(&rendered, max_tokens, "messages")?;
        match (&self.guard, marks) {
            (Some(guard), Some(marks)) => {
                let mut ids = vec![];
                for segment in guard.segments(&rendered, &marks) {
                    ids.extend(
                        match segment {
                            Segment::Template(t) => self.tokenizer.encode_chat_prompt(t),
                            Segment::Text(t) => self.tokenizer.encode_as_plain_text(t),
                        }
                        .map_err(internal)?,
                    );
                }
                Ok(ids)
            }
            _ => self.tokenizer.encode_chat_prompt(&rendered).map_err(internal),
        }
    }

    /// A completions text prompt, with the tokenizer's special tokens (BOS) unless
    /// `add_special_tokens` is false (vLLM's default and field); `field` names it in the error
    /// when it is clearly longer than `max_tokens`.
    pub fn encode_prompt(
        &self,
        text: &str,
        max_tokens: usize,
        field: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, ApiError> {
        self.refuse_clearly_over(text, max_tokens, field)?;
        self.tokenizer.encode(text, add_special_tokens).map_err(internal)
    }

    fn refuse_clearly_over(&self, text: &str, limit: usize, field: &str) -> Result<(), ApiError> {
        match prompt_size::clearly_exceeds(&self.tokenizer, text, limit).map_err(internal)? {
            Some(counted) => Err(ApiError::PromptTooLong { field: field.to_string(), limit, counted }),
            None => Ok(()),
        }
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ApiError> {
        self.tokenizer.decode(ids, skip_special_tokens).map_err(internal)
    }

    /// One token's text and raw bytes for logprobs. A byte-level token holding part of a UTF-8
    /// character decodes to U+FFFD; its real bytes come from the byte-level alphabet.
    pub fn token_piece(&self, id: u32) -> (String, Vec<u8>) {
        let text = self.tokenizer.decode(&[id], false).unwrap_or_default();
        if !text.contains('\u{FFFD}') {
            let bytes = text.as_bytes().to_vec();
            return (text, bytes);
        }
        let bytes = self
            .tokenizer
            .id_to_token(id)
            .and_then(|t| byte_level_bytes(&t))
            .unwrap_or_else(|| text.as_bytes().to_vec());
        (text, bytes)
    }

    /// The text state of one completion; `include_stop` keeps a matched stop string in the
    /// text (vLLM's `include_stop_str_in_output`).
    pub fn choice_text(
        self: &Arc<Self>,
        stop: StopMatcher,
        skip_special_tokens: bool,
        include_stop: bool,
        min_tokens: usize,
    ) -> ChoiceText {
        ChoiceText {
            text: self.clone(),
            detok: IncrementalDetokenizer::new(skip_special_tokens),
            stop,
            include_stop,
            stopped: false,
            unchecked_tokens: min_tokens,
        }
    }
}

fn internal(e: TokenizerError) -> ApiError {
    ApiError::Internal(e.to_string())
}

/// Detokenizer + stop strings for one completion.
pub struct ChoiceText {
    text: Arc<TextPipeline>,
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    include_stop: bool,
    /// A stop string ended the completion; the matcher reports it again on every later push.
    stopped: bool,
    /// Tokens still to come before stop strings count (vLLM's `min_tokens` applies to stop
    /// strings too); their text goes out unchecked.
    unchecked_tokens: usize,
}

impl ChoiceText {
    /// Text released by `token`, and the stop string that has now ended the completion.
    pub fn push(&mut self, token: u32) -> (String, Option<String>) {
        let delta = self.detok.push(&self.text.tokenizer, token).unwrap_or_else(|e| {
            tracing::warn!("detokenizing token {token}: {e}");
            String::new()
        });
        if self.unchecked_tokens > 0 {
            self.unchecked_tokens -= 1;
            return (delta, None);
        }
        let check = self.stop.push(&delta);
        self.stop_result(check)
    }

    /// The text still held back when the completion ends, and the stop string it completed.
    pub fn finish(&mut self) -> (String, Option<String>) {
        let rest = self.detok.finish(&self.text.tokenizer).unwrap_or_default();
        let check = self.stop.push(&rest);
        let (mut text, stopped) = self.stop_result(check);
        if stopped.is_none() {
            text.push_str(&self.stop.finish());
        }
        (text, stopped)
    }

    fn stop_result(&mut self, check: StopCheck) -> (String, Option<String>) {
        match check {
            StopCheck::Continue { text } => (text, None),
            StopCheck::Stopped { .. } if self.stopped => (String::new(), None),
            StopCheck::Stopped { mut text, index } => {
                self.stopped = true;
                let stop = self.stop.stop_strings()[index].clone();
                if self.include_stop {
                    text.push_str(&stop);
                }
                (text, Some(stop))
            }
        }
    }
}

/// Inverts GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other
/// 68 bytes were shifted to U+0100.. in byte order. `None` if `token` has a character outside it.
pub(crate) fn byte_level_bytes(token: &str) -> Option<Vec<u8>> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let shifted: Vec<u32> = (0..=255u32).filter(|&b| !printable(b)).collect();
    token
        .chars()
        .map(|c| {
            let c = c as u32;
            if c < 256 && printable(c) {
                Some(c as u8)
            } else {
                c.checked_sub(256).and_then(|i| shifted.get(i as usize)).map(|&b| b as u8)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::byte_level_bytes;

    #[test]
    fn byte_level_alphabet_round_trip() {
        // 'Ġ' (U+0120) is the space byte 0x20, 'Ċ' (U+010A) is '\n'; ASCII letters are themselves.
        assert_eq!(byte_level_bytes("Ġhi").unwrap(), b" hi");
        assert_eq!(byte_level_bytes("Ċ").unwrap(), b"\n");
        // "é" is 0xC3 0xA9; byte 0xC3 is 'Ã' and 0xA9 is '©' in the alphabet.
        assert_eq!(byte_level_bytes("Ã©").unwrap(), "é".as_bytes());
        assert_eq!(byte_level_bytes("｜"), None);
    }
}
