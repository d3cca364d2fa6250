//! End to end through the engine, the detokenizer, stop strings, logprobs and both response
//! forms: every choice's text is what the tokenizer decodes from the ids the scripted backend
//! generated (an independent one-shot decode), cut at stop tokens and stop strings.

use crate::fuzz::http::{endpoint, parse_json, post, scripted, stream_events, Answer};
use crate::fuzz::tokenizer;
use crate::fuzz::values::token_ids;
use proptest::prelude::*;
use serde_json::{json, Value};

/// What one choice said, read from a whole response or gathered from a stream.
#[derive(Debug, Default)]
struct ChoiceSeen {
    text: String,
    finish: Option<String>,
    /// `token_id:<id>` names from `logprobs` (`return_tokens_as_token_ids`).
    logprob_tokens: Vec<String>,
}

/// The choices of a successful answer and its `completion_tokens` (if it reported usage).
fn choices_seen(a: &Answer, chat: bool, n: usize) -> Result<(Vec<ChoiceSeen>, Option<u64>), TestCaseError> {
    let mut seen: Vec<ChoiceSeen> = (0..n).map(|_| ChoiceSeen::default()).collect();
    let (chunks, text_at) = if a.is_stream() {
        (stream_events(&a.body)?, if chat { "/delta/content" } else { "/text" })
    } else {
        (vec![parse_json(&a.body)?], if chat { "/message/content" } else { "/text" })
    };
    let mut completion_tokens = None;
    for chunk in &chunks {
        prop_assert!(chunk.get("error").is_none(), "{}", chunk);
        for c in chunk["choices"].as_array().unwrap() {
            let index = c["index"].as_u64().unwrap() as usize;
            prop_assert!(index < n, "{}", chunk);
            let choice = &mut seen[index];
            choice.text.push_str(c.pointer(text_at).and_then(Value::as_str).unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                prop_assert!(choice.finish.is_none(), "choice {} finished twice", index);
                choice.finish = Some(f.to_string());
            }
            let names = if chat {
                c["logprobs"]["content"].as_array().map(|l| l.iter().map(|t| t["token"].clone()).collect())
            } else {
                c["logprobs"]["tokens"].as_array().cloned()
            };
            choice.logprob_tokens.extend(names.unwrap_or_default().iter().map(|t| t.as_str().unwrap().to_string()));
        }
        if let Some(u) = chunk.get("usage").and_then(|u| u["completion_tokens"].as_u64()) {
            completion_tokens = Some(u);
        }
    }
    Ok((seen, completion_tokens))
}

/// What a completion must say, from the script alone: the script cycled to `max_tokens` and cut
/// at the first stop token (counted and in logprobs, not text), decoded in one go by the tokenizer, then cut
/// before the stop string that is completed first (at the same end, the longer one).
struct Expected {
    text: String,
    finish: &'static str,
    /// Ids reported in logprobs (the stop token included, as vLLM reports it) and the count in
    /// usage; unknown when a stop string ended it.
    ids: Option<Vec<u32>>,
    completion_tokens: Option<usize>,
}

fn expected(generated: &[u32], stop_ids: &[u32], stops: &[String], skip_special: bool) -> Expected {
    let (emitted, finish, count) = match generated.iter().position(|t| stop_ids.contains(t)) {
        Some(k) => (&generated[..k], "stop", k + 1),
        None => (generated, "length", generated.len()),
    };
    let full = tokenizer().decode(emitted, skip_special).unwrap();
    let first_stop = stops
        .iter()
        .filter_map(|s| full.find(s.as_str()).map(|at| (at + s.len(), std::cmp::Reverse(s.len()), at)))
        .min();
    match first_stop {
        Some((_, _, at)) => {
            Expected { text: full[..at].to_string(), finish: "stop", ids: None, completion_tokens: None }
        }
        None => Expected { text: full, finish, ids: Some(generated[..count].to_vec()), completion_tokens: Some(count) },
    }
}

/// A piece of `text` on character boundaries, as a stop string; `None` when empty.
fn substring(text: &str, a: prop::sample::Index, b: prop::sample::Index) -> Option<String> {
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
    let (a, b) = (bounds[a.index(bounds.len())], bounds[b.index(bounds.len())]);
    (a < b).then(|| text[a..b].to_string())
}

proptest! {
    #![proptest_config(crate::fuzz::config(512))]

    /// Both endpoints, streamed or not, n choices, with and without special tokens and EOS.
    #[test]
    fn generated_text_is_the_decode_of_the_script(
        script in token_ids(1..6),
        chat in any::<bool>(),
        stream in any::<bool>(),
        include_usage in any::<bool>(),
        max_tokens in 1usize..40,
        n in 1usize..4,
        ignore_eos in any::<bool>(),
        skip_special in any::<bool>(),
        stop_id_picks in prop::collection::vec(any::<prop::sample::Index>(), 0..2),
        stop_picks in prop::collection::vec(any::<(prop::sample::Index, prop::sample::Index)>(), 0..3),
        other_stops in prop::collection::vec("[a-z ]{1,3}", 0..2),
    ) {
        let generated: Vec<u32> = script.iter().copied().cycle().take(max_tokens).collect();
        let user_stop_ids: Vec<u32> = stop_id_picks.iter().map(|i| script[i.index(script.len())]).collect();
        let mut stop_ids = user_stop_ids.clone();
        if !ignore_eos {
            stop_ids.push(1); // the demo EOS
        }
        let whole = tokenizer().decode(&generated, skip_special).unwrap();
        let mut stops: Vec<String> = stop_picks.iter().filter_map(|&(a, b)| substring(&whole, a, b)).collect();
        stops.extend(other_stops);
        let want = expected(&generated, &stop_ids, &stops, skip_special);

        let mut body = json!({
            "max_tokens": max_tokens, "n": n, "ignore_eos": ignore_eos, "skip_special_tokens": skip_special,
            "stop": stops, "stop_token_ids": user_stop_ids, "stream": stream, "return_tokens_as_token_ids": true,
        });
        if chat {
            body["messages"] = json!([{"role": "user", "content": "hi"}]);
            body["logprobs"] = json!(true);
        } else {
            body["prompt"] = json!([5, 6, 7]);
            body["logprobs"] = json!(0);
        }
        if stream && include_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        let a = post(&scripted(script), endpoint(chat), body.to_string().into_bytes());
        prop_assert_eq!(a.status, 200, "{}", a.shown());
        let (seen, completion_tokens) = choices_seen(&a, chat, n)?;
        for (i, c) in seen.iter().enumerate() {
            prop_assert_eq!(&c.text, &want.text, "choice {}", i);
            prop_assert_eq!(c.finish.as_deref(), Some(want.finish), "choice {}", i);
            if let Some(ids) = &want.ids {
                let names: Vec<String> = ids.iter().map(|id| format!("token_id:{id}")).collect();
                prop_assert_eq!(&c.logprob_tokens, &names, "choice {}", i);
            }
        }
        if let (Some(got), Some(each)) = (completion_tokens, want.completion_tokens) {
            prop_assert_eq!(got, (n * each) as u64);
        }
        prop_assert_eq!(completion_tokens.is_some(), !stream || include_usage);
    }
}
