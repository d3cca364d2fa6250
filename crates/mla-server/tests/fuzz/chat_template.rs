//! Random conversations through the published DeepSeek-V2 and V3 chat templates (the repository's
//! copies in `tests/fixtures/templates/`).
//!
//! The server answers `ChatTemplateError::Syntax` with a 500 and every other error with a 400
//! (`TextPipeline::chat_prompt`); `Syntax` comes only from compiling, so whatever the messages,
//! a template that compiled must fail only with the other variants, and `chat_prompt` only with
//! a 400.

use crate::common::template_fixtures_dir;
use crate::fuzz::values::{any_json, message, text};
use crate::fuzz::{config, tokenizer};
use mla_server::chat_template::{ChatTemplate, ChatTemplateError, RenderOptions};
use mla_server::protocol::chat::MessageWire;
use mla_server::protocol::parse_fields;
use mla_server::text::{ChatPromptOptions, TextPipeline};
use mla_server::validate::messages::template_messages;
use proptest::prelude::*;
use serde_json::{Map, Value};
use std::sync::OnceLock;

const TEMPLATES: [&str; 2] = ["deepseek-v2-chat.jinja", "deepseek-v3.jinja"];

fn source(v3: bool) -> String {
    std::fs::read_to_string(template_fixtures_dir().join(TEMPLATES[v3 as usize])).unwrap()
}

/// The text pipeline of a server started with `--chat-template` set to one of `TEMPLATES`.
fn pipeline(v3: bool) -> &'static TextPipeline {
    static PIPELINES: OnceLock<[TextPipeline; 2]> = OnceLock::new();
    let make = |v3| TextPipeline::new(crate::common::demo_tokenizer(), Some(source(v3))).unwrap();
    &PIPELINES.get_or_init(|| [make(false), make(true)])[v3 as usize]
}

fn template(v3: bool) -> &'static ChatTemplate {
    static TEMPLATES: OnceLock<[ChatTemplate; 2]> = OnceLock::new();
    let make = |v3| ChatTemplate::new(&source(v3)).unwrap();
    &TEMPLATES.get_or_init(|| [make(false), make(true)])[v3 as usize]
}

/// Messages of any shape, now and then not even objects.
fn conversation() -> impl Strategy<Value = Vec<Value>> {
    prop::collection::vec(prop_oneof![8 => message(), 1 => any_json()], 0..6)
}

/// `chat_template_kwargs`-style variables, the names the renderer reserves among them.
fn extra_variables() -> impl Strategy<Value = Option<Map<String, Value>>> {
    let name = prop::sample::select(vec!["bos_token", "eos_token", "messages", "tools", "add_generation_prompt", "x"]);
    prop::option::weighted(0.2, prop::collection::btree_map(name, any_json(), 0..3))
        .prop_map(|m| m.map(|m| m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
}

proptest! {
    #![proptest_config(config(2048))]

    /// Whatever the messages and options, rendering returns (no panic) and never `Syntax`.
    #[test]
    fn rendering_never_fails_as_a_template_fault(
        messages in conversation(),
        v3 in any::<bool>(),
        add_generation_prompt in any::<bool>(),
        continue_final_message in any::<bool>(),
        tools in prop::option::weighted(0.2, prop::collection::vec(any_json(), 0..3)),
        extra in extra_variables(),
    ) {
        let options = RenderOptions {
            add_generation_prompt,
            continue_final_message,
            tools: tools.as_deref(),
            special_tokens: tokenizer().template_special_tokens(),
            extra_variables: extra.as_ref(),
        };
        let result = template(v3).render(&messages, &options);
        prop_assert!(!matches!(result, Err(ChatTemplateError::Syntax(_))), "{:?}", result);
    }

    /// Message text is data, never template code: every turn's content comes out verbatim after
    /// BOS, whatever it contains (`{{`, `{%`, special-token spellings...).
    #[test]
    fn message_text_comes_out_verbatim(
        turns in prop::collection::vec((prop::sample::select(vec!["system", "user", "assistant", "tool"]), text()), 1..6),
        v3 in any::<bool>(),
        add_generation_prompt in any::<bool>(),
    ) {
        let messages: Vec<Value> =
            turns.iter().map(|(role, content)| serde_json::json!({"role": role, "content": content})).collect();
        let options = RenderOptions {
            add_generation_prompt,
            special_tokens: tokenizer().template_special_tokens(),
            ..RenderOptions::default()
        };
        let rendered = template(v3).render(&messages, &options);
        prop_assert!(rendered.is_ok(), "{:?}", rendered);
        let rendered = rendered.unwrap();
        prop_assert!(rendered.starts_with("<｜begin▁of▁sentence｜>"), "{:?}", rendered);
        // DeepSeek-V2's template has no branch for tool results: it drops them.
        for (role, content) in turns.iter().filter(|(role, _)| v3 || *role != "tool") {
            prop_assert!(rendered.contains(content.as_str()), "{} content {:?} not in {:?}", role, content, rendered);
        }
    }
}

proptest! {
    // Each case tokenizes the rendered prompt, some of them long.
    #![proptest_config(config(512))]

    /// The server's path: the messages as the handler builds them (`template_messages`), and as
    /// any JSON, rendered, size-checked and tokenized: a prompt or a 400, never a 5xx.
    #[test]
    fn chat_prompts_fail_only_with_client_errors(
        messages in conversation(),
        v3 in any::<bool>(),
        max_tokens in prop_oneof![1usize..64, Just(256), Just(1 << 20)],
    ) {
        let mut inputs = vec![messages.clone()];
        if let Ok(wire) = parse_fields::<Vec<MessageWire>>(&Value::from(messages)) {
            inputs.extend(template_messages(&wire).ok());
        }
        for input in inputs {
            if let Err(e) = pipeline(v3).chat_prompt(&input, max_tokens, &ChatPromptOptions::generation()) {
                prop_assert_eq!(e.status().as_u16(), 400, "{:?} for {:?}", e, input);
            }
        }
    }
}
