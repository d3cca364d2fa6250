//! Non-streaming answers of the generation endpoints: the shape of chat and completion
//! responses, their text and usage, `n` choices, logprobs, prompt logprobs and echo, and
//! structured output reaching the engine. Over the real engine with a scripted backend (see
//! `common`); expected texts are decoded from the script independently.

use crate::common;

use common::{chat, demo_tokenizer, server, Options};
use serde_json::json;

#[tokio::test]
async fn chat_completion_shape_text_and_usage() {
    let s = server(Options::default());
    let r = s.post("/v1/chat/completions", chat("hi", json!({"max_tokens": 5}))).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], "demo");
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    assert_eq!(c["message"]["content"], s.script_text(5));
    assert_eq!(c["finish_reason"], "length");
    assert!(c["logprobs"].is_null());
    // The V3 template renders one user turn as BOS + <｜User｜> + text + <｜Assistant｜>.
    let prompt = demo_tokenizer().encode("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>", false).unwrap();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": 5, "total_tokens": prompt.len() + 5,
               "prompt_tokens_details": {"cached_tokens": 0},
               "prompt_cache_hit_tokens": 0, "prompt_cache_miss_tokens": prompt.len()})
    );
}

#[tokio::test]
async fn n_choices_and_chat_logprobs() {
    let s = server(Options::default());
    let body = chat("hi", json!({"max_tokens": 4, "n": 2, "logprobs": true, "top_logprobs": 2}));
    let v = s.post("/v1/chat/completions", body).await.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let text = c["message"]["content"].as_str().unwrap();
        let content = c["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 4);
        let joined: String = content.iter().map(|t| t["token"].as_str().unwrap()).collect();
        assert_eq!(joined, text);
        assert_eq!(content[0]["logprob"], -0.5);
        assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(content[0]["bytes"], json!(content[0]["token"].as_str().unwrap().as_bytes()));
    }
    assert_eq!(v["usage"]["completion_tokens"], 8);
}

#[tokio::test]
async fn completions_with_token_prompts_echo_and_logprobs() {
    let s = server(Options::default());
    let v = s.post("/v1/completions", json!({"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3})).await.json();
    assert_eq!(v["object"], "text_completion");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert!(choices.iter().all(|c| c["text"] == s.script_text(3)));
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17, "prompt_tokens_details": {"cached_tokens": 0},
               "prompt_cache_hit_tokens": 0, "prompt_cache_miss_tokens": 5})
    );

    let v = s.post("/v1/completions", json!({"prompt": "Hi", "echo": true, "max_tokens": 2})).await.json();
    assert_eq!(v["choices"][0]["text"], format!("Hi{}", s.script_text(2)));
    // A text prompt gets the tokenizer's BOS, as vLLM does.
    assert_eq!(v["usage"]["prompt_tokens"], demo_tokenizer().encode("Hi", true).unwrap().len());

    let v = s.post("/v1/completions", json!({"prompt": "Hi", "logprobs": 1, "max_tokens": 3})).await.json();
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.concat(), v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(lp["token_logprobs"], json!([-0.5, -0.5, -0.5]));
    let offsets: Vec<usize> = tokens
        .iter()
        .scan(0, |o, t| {
            let at = *o;
            *o += t.chars().count();
            Some(at)
        })
        .collect();
    assert_eq!(lp["text_offset"], json!(offsets));
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 1);

    let body = json!({"prompt": [3, 4], "logprobs": 0, "max_tokens": 3, "return_tokens_as_token_ids": true});
    let v = s.post("/v1/completions", body).await.json();
    let ids: Vec<String> = s.script[..3].iter().map(|t| format!("token_id:{t}")).collect();
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!(ids));
}

/// Prompt logprobs depend only on the prompt: with several prompts and `n: 2`, the first choice
/// of each prompt reports exactly what a request for its prompt alone with `n: 1` reports in
/// vLLM's `prompt_logprobs` (the others leave it out rather than repeat it), and every choice in
/// the legacy `logprobs` object that `echo` heads with the prompt.
#[tokio::test]
async fn prompt_logprobs_of_n_choices_are_their_prompts() {
    let s = server(Options::default());
    let prompts = [json!([5, 6, 7, 8]), json!([9, 3, 4])];
    let fields = json!({"max_tokens": 3, "prompt_logprobs": 2, "logprobs": 1, "echo": true});
    let with = |prompt: &serde_json::Value, n: usize| {
        let mut body = fields.clone();
        body["prompt"] = prompt.clone();
        body["n"] = json!(n);
        body
    };
    // What a choice reports about its prompt, as the bytes the server sent.
    let reported = |c: &serde_json::Value| (c["prompt_logprobs"].to_string(), c["logprobs"].to_string());
    let mut alone = vec![];
    for (prompt, len) in prompts.iter().zip([4, 3]) {
        let r = s.post("/v1/completions", with(prompt, 1)).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let c = r.json()["choices"][0].clone();
        let list = c["prompt_logprobs"].as_array().unwrap();
        assert_eq!(list.len(), len, "{c}");
        assert!(list[0].is_null() && list[1..].iter().all(|p| p.is_object()), "{c}");
        assert_eq!(c["logprobs"]["tokens"].as_array().unwrap().len(), len + 3, "{c}");
        alone.push(reported(&c));
    }
    assert_ne!(alone[0], alone[1], "the two prompts must be told apart");

    let r = s.post("/v1/completions", with(&json!(prompts), 2)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let v = r.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        // Choices are prompt-major: prompt i owns choices 2i and 2i + 1.
        let (vllm, legacy) = reported(c);
        assert_eq!(legacy, alone[i / 2].1, "choice {i}");
        let once = if i % 2 == 0 { alone[i / 2].0.clone() } else { "null".to_string() };
        assert_eq!(vllm, once, "choice {i}");
        // vLLM's clients read the key on every choice: `null` where the data is not repeated.
        assert!(c.get("prompt_logprobs").is_some(), "choice {i}: the key is always sent");
    }
}

#[tokio::test]
async fn structured_output_reaches_the_engine_and_bad_grammars_are_400() {
    let mut script = demo_tokenizer().encode("yes", false).unwrap();
    script.push(1); // the demo EOS id
    let s = server(Options { script, ..Options::default() });
    let v = s.post("/v1/chat/completions", chat("x", json!({"max_tokens": 10, "guided_choice": ["yes", "no"]}))).await;
    assert_eq!(v.status, 200, "{}", v.text);
    let v = v.json();
    assert_eq!(v["choices"][0]["message"]["content"], "yes");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // The scripted backend ignores masks: a token off the grammar rejects the request, visibly.
    let r = s.post("/v1/completions", json!({"prompt": "x", "max_tokens": 10, "guided_regex": "no"})).await;
    assert_eq!(r.status, 400, "{}", r.text);
    let message = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(message.starts_with("structured output: "), "{message}");
    let r = s.post("/v1/completions", json!({"prompt": "x", "guided_regex": "("})).await;
    assert_eq!((r.status.as_u16(), r.json()["error"]["param"].clone()), (400, json!("guided_regex")));
    let r = s.post("/v1/chat/completions", chat("x", json!({"guided_regex": "a", "guided_json": {}}))).await;
    assert_eq!(r.status, 400, "{}", r.text);
}
