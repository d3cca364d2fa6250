//! Generators shared by the fuzz properties: strings that stress parsing and templates, any JSON
//! value, chat messages of every shape, and token ids of the demo tokenizer.

use crate::fuzz::tokenizer;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// Strings that exercise parsing: any Unicode, multibyte text, control characters, template
/// syntax, the DeepSeek special tokens spelled out, number lookalikes, and long runs.
pub fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => any::<String>(),
        1 => Just(String::new()),
        1 => prop::sample::select(vec![
            "{{ raise_exception('x') }}{% for %}",
            "{{ messages }}{% set x = 1 %}{# c #}",
            "<｜begin▁of▁sentence｜><｜end▁of▁sentence｜><｜User｜><｜Assistant｜>",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜>",
            "é😀你\u{0}\u{FFFD}\r\n\u{1F}\u{200B}\u{10FFFF}",
            "NaN", "Infinity", "-inf", "1e999", "0x10", " 7 ", "true", "null",
            "data: [DONE]\n\n",
        ])
        .prop_map(str::to_string),
        1 => (any::<String>(), 1usize..600).prop_map(|(s, n)| s.repeat(n)),
        1 => (1usize..5000).prop_map(|n| "a".repeat(n)),
    ]
}

/// Any JSON value, a few levels deep, with the numbers that break conversions.
pub fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        prop::sample::select(vec![
            json!(u64::MAX),
            json!(i64::MIN),
            json!(1u64 << 53),
            json!(0),
            json!(-0.0),
            json!(1e308)
        ]),
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

/// A tool call in OpenAI's shape, with any text in its fields.
fn tool_call() -> impl Strategy<Value = Value> {
    let arguments = prop_oneof![Just("{\"a\": 1}".to_string()), text()];
    (text(), arguments).prop_map(|(name, arguments)| {
        json!({"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}})
    })
}

/// A message the server accepts: a known role and text content; sometimes an assistant turn of
/// tool calls (content null), a tool result with its call id, or a name.
pub fn well_formed_message() -> impl Strategy<Value = Value> {
    let role = prop::sample::select(vec!["system", "user", "assistant", "tool"]);
    let calls = prop::option::weighted(0.3, prop::collection::vec(tool_call(), 1..3));
    let name = prop::option::weighted(0.1, text());
    (role, text(), calls, name).prop_map(|(role, content, calls, name)| {
        let mut m = json!({"role": role, "content": content});
        match (role, calls) {
            ("assistant", Some(calls)) => {
                m["content"] = Value::Null;
                m["tool_calls"] = Value::from(calls);
            }
            ("tool", _) => m["tool_call_id"] = json!("call_0"),
            _ => {}
        }
        if let Some(name) = name {
            m["name"] = Value::from(name);
        }
        m
    })
}

/// A message of any shape: known and unknown roles; content as a string, text parts, other
/// parts, null, missing or junk; tool calls of any shape; junk fields.
pub fn wild_message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        3 => prop::sample::select(vec!["system", "user", "assistant", "tool"]).prop_map(Value::from),
        1 => text().prop_map(Value::from),
        1 => any_json(),
    ];
    let part = prop_oneof![
        3 => text().prop_map(|t| json!({"type": "text", "text": t})),
        1 => Just(json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})),
        1 => Just(json!({"type": "text"})),
        1 => any_json(),
    ];
    let content = prop_oneof![
        4 => text().prop_map(Value::from),
        1 => Just(Value::Null),
        1 => prop::collection::vec(part, 0..4).prop_map(Value::from),
        1 => any_json(),
    ];
    let call = prop_oneof![
        2 => tool_call(),
        1 => (any_json(), any_json()).prop_map(|(kind, function)| json!({"type": kind, "function": function})),
        1 => (text(), any_json()).prop_map(|(name, arguments)| {
            json!({"type": "function", "function": {"name": name, "arguments": arguments}})
        }),
        1 => any_json(),
    ];
    let tool_calls = prop_oneof![
        2 => Just(None),
        2 => prop::collection::vec(call, 0..3).prop_map(|c| Some(Value::from(c))),
        1 => any_json().prop_map(Some),
    ];
    let extra = prop::collection::btree_map(
        prop::sample::select(vec!["name", "tool_call_id", "reasoning_content", "x"]),
        prop_oneof![text().prop_map(Value::from), any_json()],
        0..2,
    );
    (role, prop::option::weighted(0.9, content), tool_calls, extra).prop_map(|(role, content, calls, extra)| {
        let mut m = Map::new();
        m.insert("role".into(), role);
        if let Some(content) = content {
            m.insert("content".into(), content);
        }
        if let Some(calls) = calls {
            m.insert("tool_calls".into(), calls);
        }
        for (k, v) in extra {
            m.insert(k.into(), v);
        }
        Value::Object(m)
    })
}

/// Mostly messages the server accepts, so that conversations get as far as the template.
pub fn message() -> impl Strategy<Value = Value> {
    prop_oneof![3 => well_formed_message(), 1 => wild_message()]
}

/// Demo-tokenizer ids as a model could emit them, in `runs` runs: ids that spell random text (so
/// multibyte characters span several tokens), or single ids of the whole vocabulary (special
/// tokens, tool markers, and the byte-level alphabet's lone bytes, which stand in for the
/// byte-fallback pieces of other tokenizers: alone they are cut characters).
pub fn token_ids(runs: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u32>> {
    let run = prop_oneof![
        2 => ".{1,12}".prop_map(|s| tokenizer().encode(&s, false).unwrap()),
        1 => prop::sample::select(vec!["😀👩‍👩‍👧", "你好，世界", "Café naïve", "STOP here", "a\u{10FFFF}b"])
            .prop_map(|s| tokenizer().encode(s, false).unwrap()),
        2 => (0u32..512).prop_map(|id| vec![id]),
        1 => prop::sample::select(vec![0u32, 1, 2, 501, 502, 503, 505, 511]).prop_map(|id| vec![id]),
    ];
    prop::collection::vec(run, runs).prop_map(|runs| runs.concat())
}
