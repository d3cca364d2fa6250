//! Random request bodies through the real router, in process, over the engine with a scripted
//! backend emitting random ids: the answer is never a server error, every error has OpenAI's
//! shape, every completion has choices and every stream is well formed.
//!
//! Not even a 503: the only one client input could cause is a full queue, which one request at a
//! time cannot fill (a request with more prompts than the queue holds is a 400).

use crate::fuzz::http::{check_error_body, endpoint, parse_json, post, scripted, stream_events, Answer};
use crate::fuzz::tokenizer;
use crate::fuzz::values::{any_json, text, token_ids, well_formed_message, wild_message};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// Every field either endpoint reads (`protocol::*Wire`), and one both ignore.
const FIELDS: [&str; 31] = [
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
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "return_tokens_as_token_ids",
    "logit_bias",
    "best_of",
    "suffix",
    "response_format",
    "tools",
    "tool_choice",
    "user",
];

fn floats(range: std::ops::Range<f64>) -> BoxedStrategy<Value> {
    range.prop_map(Value::from).boxed()
}

fn ints(range: std::ops::Range<i64>) -> BoxedStrategy<Value> {
    range.prop_map(Value::from).boxed()
}

fn token_list(ids: std::ops::Range<i64>, len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<Value>> {
    prop::collection::vec(ids.prop_map(Value::from), len)
}

/// A value validation accepts, so that most requests reach the engine and come back as text.
fn valid_value(name: &str) -> BoxedStrategy<Value> {
    let non_empty = || text().prop_filter("stop strings are not empty", |s| !s.is_empty());
    match name {
        "temperature" => floats(0.0..2.0),
        "top_p" => prop_oneof![floats(0.01..1.0), Just(json!(1))].boxed(),
        "min_p" => floats(0.0..1.0),
        "presence_penalty" | "frequency_penalty" => floats(-2.0..2.0),
        "repetition_penalty" => floats(0.5..2.0),
        "max_tokens" | "max_completion_tokens" => ints(1..30),
        "n" => ints(1..4),
        "top_k" => ints(-1..50),
        "seed" => any::<i64>().prop_map(Value::from).boxed(),
        "logprobs" => prop_oneof![any::<bool>().prop_map(Value::from), ints(0..5)].boxed(),
        "top_logprobs" => ints(0..5),
        "stream" | "echo" | "ignore_eos" | "skip_special_tokens" | "return_tokens_as_token_ids" => {
            any::<bool>().prop_map(Value::from).boxed()
        }
        "stop" => prop_oneof![
            non_empty().prop_map(Value::from),
            // Short ones may occur in the generated text.
            prop::collection::vec(prop_oneof!["[a-z. ]{1,3}", non_empty()], 0..4).prop_map(|v| json!(v)),
        ]
        .boxed(),
        "stop_token_ids" => token_list(0..512, 0..4).prop_map(Value::from).boxed(),
        "stream_options" => any::<bool>().prop_map(|b| json!({"include_usage": b})).boxed(),
        "model" => Just(json!("demo")).boxed(),
        "logit_bias" => Just(json!({})).boxed(),
        "best_of" => Just(json!(1)).boxed(),
        "suffix" => Just(json!("")).boxed(),
        "response_format" => Just(json!({"type": "text"})).boxed(),
        "tools" => Just(json!([])).boxed(),
        "tool_choice" => Just(json!("none")).boxed(),
        "prompt" => prop_oneof![
            non_empty().prop_map(Value::from),
            prop::collection::vec(non_empty(), 1..3).prop_map(|v| json!(v)),
            token_list(0..512, 1..50).prop_map(Value::from),
            prop::collection::vec(token_list(0..512, 1..8), 1..3).prop_map(|v| json!(v)),
        ]
        .boxed(),
        "messages" => prop::collection::vec(well_formed_message(), 1..4).prop_map(Value::from).boxed(),
        _ => text().prop_map(Value::from).boxed(),
    }
}

/// A value out of range, of the wrong type, or at a corner: what validation must refuse (with
/// a 400 naming the field) or survive.
fn wild_value(name: &str) -> BoxedStrategy<Value> {
    let any_int = || {
        prop_oneof![
            any::<i64>().prop_map(Value::from),
            ints(-5..1),
            Just(json!(u64::MAX)),
            Just(json!(i64::MIN)),
            Just(json!(1.5)),
            Just(json!("1")),
        ]
    };
    match name {
        "temperature" | "top_p" | "min_p" | "presence_penalty" | "frequency_penalty" | "repetition_penalty" => {
            prop_oneof![
                floats(-1e6..1e6),
                prop::sample::select(vec![-0.0, 2.000_000_1, f64::MAX, f64::MIN_POSITIVE, -2.000_000_1, 1e-320])
                    .prop_map(Value::from),
                Just(json!("NaN")),
                Just(json!(true)),
            ]
            .boxed()
        }
        "max_tokens" | "max_completion_tokens" | "n" | "top_k" | "logprobs" | "top_logprobs" | "seed" | "best_of" => {
            prop_oneof![any_int(), ints(100..300)].boxed()
        }
        "stop" => prop::collection::vec(text().prop_map(Value::from), 0..70).prop_map(Value::from).boxed(),
        "stop_token_ids" => token_list(-2..600, 0..5).prop_map(Value::from).boxed(),
        "prompt" => prop_oneof![
            text().prop_map(Value::from),
            prop::collection::vec(text().prop_map(Value::from), 0..4).prop_map(Value::from),
            token_list(-2..600, 0..300).prop_map(Value::from),
            prop::collection::vec(token_list(-1..520, 0..5), 0..70).prop_map(|v| json!(v)),
            // Long enough to be counted piece by piece (`prompt_size`) before it is tokenized.
            (prop::collection::vec(text(), 1..4), 70_000usize..140_000).prop_map(|(words, bytes)| {
                let unit = words.join(" ") + " b";
                json!(unit.repeat(bytes / unit.len() + 1))
            }),
        ]
        .boxed(),
        "messages" => prop::collection::vec(wild_message(), 0..6).prop_map(Value::from).boxed(),
        "model" => text().prop_map(Value::from).boxed(),
        "stream_options" => prop_oneof![Just(json!({"include_usage": "yes"})), any_json()].boxed(),
        "logit_bias" => prop::collection::btree_map("-?[0-9]{1,6}|[a-z]{1,3}", floats(-150.0..150.0), 1..4)
            .prop_map(|m| json!(m))
            .boxed(),
        "suffix" => text().prop_map(Value::from).boxed(),
        "response_format" => prop_oneof![
            Just(json!({"type": "json_object"})),
            Just(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}})),
        ]
        .boxed(),
        "tools" => Just(json!([{"type": "function", "function": {"name": "f", "parameters": {}}}])).boxed(),
        "tool_choice" => prop_oneof![Just(json!("auto")), Just(json!({"type": "function"}))].boxed(),
        _ => any_json().boxed(),
    }
}

fn field_value(name: &'static str) -> BoxedStrategy<Value> {
    prop_oneof![4 => valid_value(name), 1 => wild_value(name), 1 => any_json()].boxed()
}

/// A request body for one endpoint: a valid start (its prompt or messages, a small max_tokens),
/// then a few fields set to random values, and junk fields.
fn request_body(chat: bool) -> impl Strategy<Value = Value> {
    let required = if chat { "messages" } else { "prompt" };
    let start = (valid_value(required), valid_value("max_tokens"))
        .prop_map(move |(v, max)| json!({required: v, "max_tokens": max}));
    let fields = prop::sample::subsequence(FIELDS.to_vec(), 0..6)
        .prop_flat_map(|names| names.into_iter().map(|n| field_value(n).prop_map(move |v| (n, v))).collect::<Vec<_>>());
    let junk = prop::collection::btree_map("[a-z]{1,8}", any_json(), 0..2);
    (start, fields, junk).prop_map(|(mut body, fields, junk)| {
        let object: &mut Map<String, Value> = body.as_object_mut().unwrap();
        object.extend(junk);
        for (name, value) in fields {
            object.insert(name.to_string(), value);
        }
        body
    })
}

/// JSON literals a `serde_json::Value` cannot hold or that parse to something unexpected: out of
/// range numbers, integers written as floats, NaN and infinities (bare, which is not JSON, and as
/// strings), numbers beyond 64 bits.
const LITERALS: [&str; 22] = [
    "1e400",
    "-1e400",
    "1e-400",
    "-0",
    "-0.0",
    "1.0",
    "2.5",
    "1E2",
    "18446744073709551616",
    "-9223372036854775809",
    "9223372036854775807",
    "123456789012345678901234567890",
    "NaN",
    "Infinity",
    "-Infinity",
    "\"NaN\"",
    "\"Infinity\"",
    "\"-inf\"",
    "\"1\"",
    "\"0.5\"",
    "0.0000001",
    "01",
];

/// A request body as text, sometimes with fields replaced by raw `LITERALS` (the last of
/// duplicate keys wins in serde_json).
fn request_text(chat: bool) -> impl Strategy<Value = String> {
    let literal = (prop::sample::select(FIELDS.to_vec()), prop::sample::select(LITERALS.to_vec()));
    let literals = prop_oneof![3 => Just(vec![]), 1 => prop::collection::vec(literal, 1..3)];
    (request_body(chat), literals).prop_map(|(body, literals)| {
        let mut text = body.to_string();
        text.pop(); // the closing brace
        for (name, literal) in literals {
            if !text.ends_with('{') {
                text.push(',');
            }
            text.push_str(&format!("\"{name}\":{literal}"));
        }
        text.push('}');
        text
    })
}

/// Request bytes, shown as a byte string when proptest reports a failing input.
struct RawBody(Vec<u8>);

impl std::fmt::Debug for RawBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "b\"{}\"", self.0.escape_ascii())
    }
}

/// A body as bytes: random ones (not necessarily UTF-8), JSON that is not an object, requests cut
/// short or with one byte replaced, and nesting deeper than the parser allows.
fn raw_body(chat: bool) -> impl Strategy<Value = RawBody> {
    let bytes = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        any_json().prop_map(|v| v.to_string().into_bytes()),
        (request_text(chat), any::<prop::sample::Index>()).prop_map(|(text, cut)| {
            let mut bytes = text.into_bytes();
            bytes.truncate(cut.index(bytes.len() + 1));
            bytes
        }),
        (request_text(chat), any::<prop::sample::Index>(), any::<u8>()).prop_map(|(text, at, b)| {
            let mut bytes = text.into_bytes();
            let at = at.index(bytes.len());
            bytes[at] = b;
            bytes
        }),
        (1usize..400).prop_map(|depth| {
            format!("{{\"prompt\": \"x\", \"tool_choice\": {}{}}}", "[".repeat(depth), "]".repeat(depth)).into_bytes()
        }),
    ];
    bytes.prop_map(RawBody)
}

/// An answer a client can act on: no server fault; an error in OpenAI's shape; a completion with
/// choices; a stream of chunks with choices or error events in the error shape, then `[DONE]`.
fn check_answer(a: &Answer) -> Result<(), TestCaseError> {
    prop_assert!(a.status < 500, "status {}: {}", a.status, a.shown());
    if a.status >= 400 {
        prop_assert!(a.content_type.starts_with("application/json"), "{}: {}", a.content_type, a.shown());
        return check_error_body(&parse_json(&a.body)?);
    }
    prop_assert_eq!(a.status, 200, "{}", a.shown());
    if a.is_stream() {
        for event in stream_events(&a.body)? {
            if event.get("error").is_some() {
                check_error_body(&event)?;
            } else {
                prop_assert!(event["choices"].is_array(), "{}", event);
            }
        }
    } else {
        let v = parse_json(&a.body)?;
        prop_assert!(v["choices"].as_array().is_some_and(|c| !c.is_empty()), "{}", v);
    }
    Ok(())
}

fn chat_and_body<S: Strategy>(body: impl Fn(bool) -> S) -> impl Strategy<Value = (bool, S::Value)> {
    prop_oneof![body(true).prop_map(|b| (true, b)), body(false).prop_map(|b| (false, b))]
}

proptest! {
    #![proptest_config(crate::fuzz::config(512))]

    #[test]
    fn structured_requests_never_get_a_server_error(
        (chat, body) in chat_and_body(request_text),
        script in token_ids(1..8),
    ) {
        check_answer(&post(&scripted(script), endpoint(chat), body.into_bytes()))?;
    }

    #[test]
    fn raw_bodies_never_get_a_server_error((chat, body) in chat_and_body(raw_body)) {
        let a = post(&scripted(tokenizer().encode("Hello", false).unwrap()), endpoint(chat), body.0);
        prop_assert!([200, 400, 404].contains(&a.status), "{}: {}", a.status, a.shown());
        check_answer(&a)?;
    }
}
