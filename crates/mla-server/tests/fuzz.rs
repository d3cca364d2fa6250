//! Property tests in the place of a fuzzer (cargo-fuzz needs a nightly compiler, CI runs
//! stable): random request bodies through the real router, random conversations through the
//! DeepSeek chat templates, random token ids through the incremental detokenizer.
//!
//! CI runs `PROPTEST_CASES` cases of each (default 256, a few seconds in all); run them longer
//! with e.g. `PROPTEST_CASES=100000 cargo test -p mla-server --test fuzz --release`. A failure
//! prints the shrunk input and is saved under `proptest-regressions/` to be replayed first.

mod common;

use common::{demo_tokenizer, server, template_fixtures_dir, Options};
use mla_server::chat_template::{ChatTemplate, ChatTemplateError, RenderOptions};
use mla_server::detokenizer::IncrementalDetokenizer;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// Strings that exercise parsing: ASCII, multibyte, control characters, template syntax,
/// special-token lookalikes, and long runs.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        Just(String::new()),
        Just("{{ raise_exception('x') }}{% for %}".to_string()),
        Just("<｜begin▁of▁sentence｜><｜end▁of▁sentence｜><｜User｜>".to_string()),
        Just("é😀\u{0}\u{FFFD}\r\n".to_string()),
        (1usize..5000).prop_map(|n| "a".repeat(n)),
    ]
}

/// Any JSON value, a few levels deep.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        prop_oneof![Just(u64::MAX), Just(1u64 << 53), Just(0)].prop_map(Value::from),
        text().prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A value for a known request field: usually a plausible one, often one out of range or of
/// the wrong type.
fn field_value(name: &'static str) -> BoxedStrategy<Value> {
    let plausible: BoxedStrategy<Value> = match name {
        "temperature" | "top_p" | "min_p" | "presence_penalty" | "frequency_penalty" | "repetition_penalty" => {
            (-3.0f64..5.0).prop_map(Value::from).boxed()
        }
        "max_tokens" | "max_completion_tokens" | "n" | "top_k" | "logprobs" | "top_logprobs" | "seed" => {
            prop_oneof![(-5i64..300).prop_map(Value::from), any::<i64>().prop_map(Value::from)].boxed()
        }
        "stream" | "echo" | "ignore_eos" | "skip_special_tokens" => any::<bool>().prop_map(Value::from).boxed(),
        "stop" => prop_oneof![
            text().prop_map(Value::from),
            prop::collection::vec(text().prop_map(Value::from), 0..70).prop_map(Value::from),
        ]
        .boxed(),
        "stop_token_ids" => {
            prop::collection::vec((-2i64..600).prop_map(Value::from), 0..5).prop_map(Value::from).boxed()
        }
        "prompt" => prop_oneof![
            text().prop_map(Value::from),
            prop::collection::vec(text().prop_map(Value::from), 0..4).prop_map(Value::from),
            prop::collection::vec((-2i64..600).prop_map(Value::from), 0..300).prop_map(Value::from),
            prop::collection::vec(prop::collection::vec((0i64..600).prop_map(Value::from), 0..5), 0..3)
                .prop_map(|v| json!(v)),
        ]
        .boxed(),
        "messages" => prop::collection::vec(message(), 0..5).prop_map(Value::from).boxed(),
        "model" => prop_oneof![Just(json!("demo")), text().prop_map(Value::from)].boxed(),
        "stream_options" => prop_oneof![Just(json!({"include_usage": true})), any_json()].boxed(),
        _ => any_json().boxed(),
    };
    prop_oneof![8 => plausible, 1 => any_json()].boxed()
}

fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        Just(json!("system")),
        Just(json!("user")),
        Just(json!("assistant")),
        Just(json!("tool")),
        text().prop_map(Value::from),
    ];
    let content = prop_oneof![
        4 => text().prop_map(Value::from),
        1 => Just(Value::Null),
        1 => prop::collection::vec(
            prop_oneof![text().prop_map(|t| json!({"type": "text", "text": t})), any_json()],
            0..3
        )
        .prop_map(Value::from),
        1 => any_json(),
    ];
    let tool_calls = prop_oneof![
        3 => Just(None),
        1 => Just(Some(json!([{"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]))),
        1 => Just(Some(json!([{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]))),
        1 => any_json().prop_map(Some),
    ];
    (role, content, tool_calls).prop_map(|(role, content, calls)| {
        let mut m = json!({"role": role, "content": content});
        if let Some(calls) = calls {
            m["tool_calls"] = calls;
        }
        m
    })
}

const FIELDS: [&str; 20] = [
    "model",
    "messages",
    "prompt",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "stop_token_ids",
    "seed",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "presence_penalty",
    "ignore_eos",
];

/// A request body: a random subset of the known fields with random values, plus junk fields.
fn request_body() -> impl Strategy<Value = Value> {
    let fields = prop::sample::subsequence(FIELDS.to_vec(), 0..FIELDS.len())
        .prop_flat_map(|names| names.into_iter().map(|n| field_value(n).prop_map(move |v| (n, v))).collect::<Vec<_>>());
    let junk = prop::collection::btree_map("[a-z]{1,8}", any_json(), 0..3);
    (fields, junk).prop_map(|(fields, junk)| {
        let mut body: Map<String, Value> = junk.into_iter().collect();
        for (name, value) in fields {
            body.insert(name.to_string(), value);
        }
        Value::Object(body)
    })
}

/// A body as bytes: random ones, JSON that is not an object, and requests cut short.
fn raw_body() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512).prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        any_json().prop_map(|v| v.to_string()),
        (request_body(), any::<prop::sample::Index>()).prop_map(|(v, cut)| {
            let text = v.to_string();
            let mut end = cut.index(text.len() + 1);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text[..end].to_string()
        }),
    ]
}

/// An answer the client could act on: not a server fault, and any error in OpenAI's shape.
fn check_reply(status: u16, text: &str, content_type: &str) -> Result<(), TestCaseError> {
    prop_assert!(status < 500, "status {status}: {text}");
    if status >= 400 {
        let v: Value = serde_json::from_str(text).map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
        let e = &v["error"];
        prop_assert!(e["message"].is_string() && e["type"].is_string(), "{text}");
        prop_assert!(e.as_object().is_some_and(|o| o.contains_key("param") && o.contains_key("code")), "{text}");
    } else if content_type.starts_with("text/event-stream") {
        prop_assert!(text.ends_with("data: [DONE]\n\n"), "stream not terminated: {text:?}");
    }
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn structured_requests_never_get_a_server_error(body in request_body(), chat in any::<bool>()) {
        let rt = runtime();
        let s = rt.block_on(async { server(Options::default()) });
        let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
        let r = rt.block_on(s.post(path, body));
        check_reply(r.status.as_u16(), &r.text, &r.content_type)?;
    }

    #[test]
    fn raw_bodies_never_get_a_server_error(body in raw_body(), chat in any::<bool>()) {
        let rt = runtime();
        let s = rt.block_on(async { server(Options::default()) });
        let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
        let r = rt.block_on(s.call("POST", path, Some(&body), &[("content-type", "application/json")]));
        prop_assert!(r.status.as_u16() == 400 || r.status.as_u16() == 404 || r.status.is_success(), "{}: {}", r.status, r.text);
        check_reply(r.status.as_u16(), &r.text, &r.content_type)?;
    }

    #[test]
    fn deepseek_templates_refuse_bad_conversations_as_client_errors(
        messages in prop::collection::vec(message(), 0..6),
        add_generation_prompt in any::<bool>(),
        v3 in any::<bool>(),
    ) {
        let name = if v3 { "deepseek-v3.jinja" } else { "deepseek-v2-chat.jinja" };
        let source = std::fs::read_to_string(template_fixtures_dir().join(name)).unwrap();
        let template = ChatTemplate::new(&source).unwrap();
        let tokenizer = demo_tokenizer();
        let options = RenderOptions {
            add_generation_prompt,
            special_tokens: tokenizer.template_special_tokens(),
            ..RenderOptions::default()
        };
        // Ok, or an error the server answers with 400; `Syntax` (500) would be the template's
        // fault, and it compiled.
        let result = template.render(&messages, &options);
        prop_assert!(!matches!(result, Err(ChatTemplateError::Syntax(_))), "{result:?}");
    }

    #[test]
    fn detokenized_deltas_add_up_to_the_whole_decode(
        ids in prop::collection::vec(0u32..512, 0..64),
        skip_special in any::<bool>(),
    ) {
        let tokenizer = demo_tokenizer();
        let mut detok = IncrementalDetokenizer::new(skip_special);
        let mut text = String::new();
        for &id in &ids {
            text.push_str(&detok.push(&tokenizer, id).unwrap());
        }
        text.push_str(&detok.finish(&tokenizer).unwrap());
        prop_assert_eq!(text, tokenizer.decode(&ids, skip_special).unwrap());
    }
}

/// Cases per property: `PROPTEST_CASES` when set, else 256 (a few seconds in a debug build).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
}
