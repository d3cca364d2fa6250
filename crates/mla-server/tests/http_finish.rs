//! How choices end: a stop string cuts the text and ends its choice with `stop`, in the engine
//! too (a choice stops decoding while its siblings run on), EOS ends it unless ignored, and
//! `/metrics` counts those endings as stops, not aborts. Over the real engine with a scripted
//! backend (see `common`).

use crate::common;

use common::{chat, demo_tokenizer, server, wait_idle, Options};
use serde_json::json;

#[tokio::test]
async fn stop_strings_cut_the_text_and_end_with_stop() {
    let s = server(Options::default());
    let r = s.post("/v1/chat/completions", chat("hi", json!({"max_tokens": 40, "stop": ["STOP", "never"]}))).await;
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello there. ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Tokens are counted up to the one that completed the stop string.
    let k = (1..=s.script.len()).find(|&k| s.script_text(k).contains("STOP")).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], k);
}

#[tokio::test]
async fn eos_ends_with_stop_unless_ignored() {
    let mut script = demo_tokenizer().encode("ab", false).unwrap();
    script.push(1); // the demo EOS id
    let s = server(Options { script: script.clone(), ..Options::default() });
    let v = s.post("/v1/chat/completions", chat("x", json!({"max_tokens": 10}))).await.json();
    assert_eq!(v["choices"][0]["message"]["content"], "ab");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], script.len(), "the EOS token is counted");
    let v = s.post("/v1/chat/completions", chat("x", json!({"max_tokens": 4, "ignore_eos": true}))).await.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let v = s
        .post(
            "/v1/chat/completions",
            chat("x", json!({"max_tokens": 4, "ignore_eos": true, "skip_special_tokens": false})),
        )
        .await
        .json();
    let four: Vec<u32> = script.iter().copied().cycle().take(4).collect();
    let expected = demo_tokenizer().decode(&four, false).unwrap();
    assert!(expected.contains("<｜end▁of▁sentence｜>"), "{expected}");
    assert_eq!(v["choices"][0]["message"]["content"], expected);
}

/// The `/metrics` sample of `series` with `labels` (after `model_name="demo",`), as a number.
async fn metric(s: &common::TestServer, series: &str, labels: &str) -> f64 {
    let text = s.call("GET", "/metrics", None, &[]).await.text;
    let key = format!("{series}{{model_name=\"demo\"{labels}}} ");
    let line = text.lines().find(|l| l.starts_with(&key)).unwrap_or_else(|| panic!("no {key} in {text}"));
    line[key.len()..].parse().unwrap()
}

#[tokio::test]
async fn a_stop_string_ends_its_choice_in_the_engine_and_the_other_runs_on() {
    // Choice 0 says "Hello there. STOP ...", choice 1 never says STOP.
    let sibling = demo_tokenizer().encode("and so on, on and on, ", false).unwrap();
    let s = server(Options {
        sibling_script: Some(sibling.clone()),
        delay: std::time::Duration::from_millis(10),
        ..Options::default()
    });
    let body = json!({"prompt": "x", "n": 2, "max_tokens": 40, "stop": "STOP", "ignore_eos": true});
    let v = s.post("/v1/completions", body).await.json();
    assert_eq!(v["choices"][0]["text"], "Hello there. ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let forty: Vec<u32> = sibling.iter().copied().cycle().take(40).collect();
    assert_eq!(v["choices"][1]["text"], demo_tokenizer().decode(&forty, true).unwrap());
    assert_eq!(v["choices"][1]["finish_reason"], "length");
    let k = (1..=s.script.len()).find(|&k| s.script_text(k).contains("STOP")).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], k + 40);

    wait_idle(&s).await;
    let finished = |reason: &'static str| format!(",finished_reason=\"{reason}\"");
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("stop")).await, 1.0);
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("length")).await, 1.0);
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("abort")).await, 0.0);
    // The request counts once, as truncated: one of its answers is.
    assert_eq!(metric(&s, "mla:request_success_total", &finished("length")).await, 1.0);
    assert_eq!(metric(&s, "mla:request_success_total", &finished("stop")).await, 0.0);
    assert_eq!(metric(&s, "mla:num_requests_running", "").await, 0.0);
    assert_eq!(metric(&s, "mla:kv_cache_usage_perc", "").await, 0.0);
    // Choice 0 was decoded a few steps past its stop string at most, not for all 40 steps
    // its sibling ran (80 tokens in all when the engine only learnt of the stop at the end).
    let generated = metric(&s, "mla:generation_tokens_total", "").await as usize;
    assert!(generated >= k + 40 && generated <= k + 40 + 10, "{generated} tokens generated for {} delivered", k + 40);
}

#[tokio::test]
async fn stop_strings_ending_every_choice_count_as_stops_not_aborts() {
    // Steps take a few milliseconds, as on a GPU, so the server reads each stop-completing token
    // long before the engine would reach max_tokens (see `metrics` for the race when it does not).
    let s = server(Options { delay: std::time::Duration::from_millis(5), ..Options::default() });
    for stream in [false, true] {
        let body =
            json!({"prompt": "x", "n": 3, "max_tokens": 40, "stop": "STOP", "ignore_eos": true, "stream": stream});
        let r = s.post("/v1/completions", body).await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    wait_idle(&s).await;
    let finished = |reason: &'static str| format!(",finished_reason=\"{reason}\"");
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("stop")).await, 6.0);
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("abort")).await, 0.0);
    assert_eq!(metric(&s, "mla:completion_success_total", &finished("length")).await, 0.0);
    assert_eq!(metric(&s, "mla:request_success_total", &finished("stop")).await, 2.0);
}
