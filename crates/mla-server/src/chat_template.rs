//! Chat templates rendered byte for byte as HF transformers' `apply_chat_template(tokenize=False)`.
//!
//! Messages arrive in OpenAI request form (JSON objects). The only change made before the template
//! sees them is vLLM's: content given as a list of text parts becomes one string, the texts joined
//! by "\n" (DeepSeek's templates concatenate `message['content']` as a string). Everything else,
//! including assistant `tool_calls` with their JSON-string `arguments`, is passed through as is.

use crate::template_env::{chat_template_environment, raised_message};
use minijinja::value::Value;
use minijinja::Environment;
use serde_json::{Map, Value as Json};
use std::collections::BTreeMap;

const TEMPLATE_NAME: &str = "chat_template";
/// transformers' marker for `continue_final_message` (its exact spelling matters: it is searched for).
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";
/// Variables the renderer itself sets; `extra_variables` may not replace them (HF raises too).
pub const RESERVED_VARIABLES: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("the chat template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception`: it refuses this conversation (a client error).
    #[error("{0}")]
    Raised(String),
    #[error("rendering the chat template failed: {0}")]
    Render(String),
    #[error("invalid messages: {0}")]
    InvalidMessages(String),
}

/// What one rendering needs besides the messages.
#[derive(Debug, Clone, Copy, Default)]
pub struct RenderOptions<'a> {
    pub add_generation_prompt: bool,
    /// End the prompt inside the final (assistant) message so the model continues it.
    pub continue_final_message: bool,
    /// Tool schemas in OpenAI form; `None` renders as Python `None`, as in HF.
    pub tools: Option<&'a [Json]>,
    /// Named special tokens visible to the template (`bos_token`, `eos_token`, ...).
    pub special_tokens: &'a [(String, String)],
    /// Extra template variables (vLLM's `chat_template_kwargs`); they override special tokens.
    pub extra_variables: Option<&'a Map<String, Json>>,
}

/// A compiled chat template; compile once per model, render per request.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<Self, ChatTemplateError> {
        let mut env = chat_template_environment();
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ChatTemplateError::Syntax(e.to_string()))?;
        Ok(Self { env, source: source.to_string() })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt text for `messages`, exactly as transformers renders it.
    pub fn render(&self, messages: &[Json], options: &RenderOptions) -> Result<String, ChatTemplateError> {
        if messages.is_empty() {
            return Err(ChatTemplateError::InvalidMessages(
                "cannot apply the chat template to an empty conversation".into(),
            ));
        }
        let mut messages = flatten_text_parts(messages)?;
        if !options.continue_final_message {
            return self.render_flat(&messages, options);
        }
        if options.add_generation_prompt {
            return Err(ChatTemplateError::InvalidMessages(
                "continue_final_message and add_generation_prompt cannot both be set".into(),
            ));
        }
        // transformers' method: mark the end of the final message, render, cut at the mark.
        let final_text = append_continue_tag(messages.last_mut().expect("not empty"))?;
        if !self.source.contains("content") {
            return Err(ChatTemplateError::InvalidMessages(
                "continue_final_message needs a template that renders message content".into(),
            ));
        }
        let rendered = self.render_flat(&messages, options)?;
        let tag = CONTINUE_TAG.trim_end();
        let (Some(tag_at), true) = (rendered.rfind(tag), rendered.contains(py_strip(&final_text))) else {
            return Err(ChatTemplateError::InvalidMessages(
                "continue_final_message: the final message does not appear in the rendered prompt".into(),
            ));
        };
        Ok(if rendered[tag_at..].starts_with(CONTINUE_TAG) {
            rendered[..tag_at].to_string()
        } else {
            // The template trimmed the message, so trailing spacing is not the user's.
            py_rstrip(&rendered[..tag_at]).to_string()
        })
    }

    fn render_flat(&self, messages: &[Json], options: &RenderOptions) -> Result<String, ChatTemplateError> {
        let mut context: BTreeMap<String, Value> = BTreeMap::new();
        for (name, text) in options.special_tokens {
            context.insert(name.clone(), Value::from(text.as_str()));
        }
        if let Some(extra) = options.extra_variables {
            for (name, value) in extra {
                if RESERVED_VARIABLES.contains(&name.as_str()) {
                    return Err(ChatTemplateError::InvalidMessages(format!(
                        "chat template variable `{name}` is set by the server and cannot be overridden"
                    )));
                }
                context.insert(name.clone(), Value::from_serialize(value));
            }
        }
        context.insert("messages".into(), Value::from_serialize(messages));
        context.insert("tools".into(), Value::from_serialize(options.tools));
        context.insert("documents".into(), Value::from(()));
        context.insert("add_generation_prompt".into(), Value::from(options.add_generation_prompt));

        let template = self.env.get_template(TEMPLATE_NAME).expect("added in new()");
        template.render(context).map_err(|e| match raised_message(&e) {
            Some(message) => ChatTemplateError::Raised(message),
            None => ChatTemplateError::Render(e.to_string()),
        })
    }
}

/// vLLM's flattening for string-content templates: `[{type: text, text}, ...]` → texts joined by
/// "\n". Other part types (images, audio) have no meaning for a text-only model and are refused.
pub fn flatten_text_parts(messages: &[Json]) -> Result<Vec<Json>, ChatTemplateError> {
    messages
        .iter()
        .enumerate()
        .map(|(i, message)| {
            let Json::Object(fields) = message else {
                return Err(ChatTemplateError::InvalidMessages(format!("messages[{i}] is not an object")));
            };
            let mut fields = fields.clone();
            if let Some(Json::Array(parts)) = fields.get("content") {
                let texts = parts
                    .iter()
                    .enumerate()
                    .map(|(j, part)| text_of_part(part).ok_or_else(|| {
                        ChatTemplateError::InvalidMessages(format!(
                            "messages[{i}].content[{j}]: only parts {{\"type\": \"text\", \"text\": string}} are supported"
                        ))
                    }))
                    .collect::<Result<Vec<&str>, _>>()?;
                let joined = texts.join("\n");
                fields.insert("content".into(), Json::String(joined));
            }
            Ok(Json::Object(fields))
        })
        .collect()
}

fn text_of_part(part: &Json) -> Option<&str> {
    match (part.get("type")?.as_str()?, part.get("text")?.as_str()) {
        ("text", Some(text)) => Some(text),
        _ => None,
    }
}

/// Appends the continuation tag to the final message's content; returns the content before it.
fn append_continue_tag(message: &mut Json) -> Result<String, ChatTemplateError> {
    match message.get_mut("content") {
        Some(Json::String(content)) => {
            let original = content.clone();
            content.push_str(CONTINUE_TAG);
            Ok(original)
        }
        _ => Err(ChatTemplateError::InvalidMessages(
            "continue_final_message is set but the final message has no text content to continue".into(),
        )),
    }
}

/// Python's `str.isspace` set (Unicode White_Space plus the ASCII separators 0x1c..0x1f).
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn py_strip(s: &str) -> &str {
    s.trim_matches(is_py_space)
}

fn py_rstrip(s: &str) -> &str {
    s.trim_end_matches(is_py_space)
}
