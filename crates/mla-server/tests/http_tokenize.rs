//! `/tokenize`: it counts the prompt chat would send for the same messages, refuses prompts
//! longer than the context as the generation endpoints do, and names the field at fault.

use crate::common;

use common::{server, Options};
use serde_json::json;

/// `/tokenize` with `messages` counts the prompt that chat would send for the same messages,
/// chat prompt options and tools.
#[tokio::test]
async fn tokenize_messages_counts_the_chat_prompt() {
    let s = server(Options::default());
    let tools = json!([{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]);
    let bodies = [
        json!({"messages": [{"role": "user", "content": "hi"}]}),
        json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "none"}),
        json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
               "add_generation_prompt": false, "continue_final_message": true}),
    ];
    let mut counts = vec![];
    for body in bodies {
        let r = s.post("/tokenize", body.clone()).await;
        assert_eq!(r.status, 200, "{body}: {}", r.text);
        let v = r.json();
        assert_eq!(v["count"], v["tokens"].as_array().unwrap().len());
        let mut chat = body.clone();
        chat["max_tokens"] = json!(1);
        let r = s.post("/v1/chat/completions", chat).await;
        assert_eq!(r.status, 200, "{body}: {}", r.text);
        assert_eq!(v["count"], r.json()["usage"]["prompt_tokens"], "{body}");
        counts.push(v["count"].as_u64().unwrap());
    }
    // (The demo model's V3 template does not render tools; the count equals chat's all the same.)
    assert_ne!(counts[2], counts[0], "the options shape the prompt: {counts:?}");
}

/// `/tokenize` refuses what the generation endpoints refuse: more tokens than the context holds,
/// for a prompt and for messages, counted without tokenizing a long text whole.
#[tokio::test]
async fn tokenize_refuses_prompts_longer_than_the_context() {
    let s = server(Options::default());
    // Byte-level tokens of the demo tokenizer: 'z' is one token, so MAX_MODEL_LEN of them fit
    // with no BOS and one more does not.
    let fits = "z".repeat(common::MAX_MODEL_LEN);
    let r = s.post("/tokenize", json!({"prompt": fits, "add_special_tokens": false})).await;
    assert_eq!((r.status.as_u16(), r.json()["count"].clone()), (200, json!(common::MAX_MODEL_LEN)), "{}", r.text);
    let over = format!("{fits}z");
    let long = "lorem ipsum ".repeat(20_000);
    for body in [
        json!({"prompt": over, "add_special_tokens": false}),
        json!({"prompt": long}),
        json!({"messages": [{"role": "user", "content": long}]}),
    ] {
        let r = s.post("/tokenize", body.clone()).await;
        assert_eq!(r.status, 400, "{}", r.text);
        assert_eq!(r.json()["error"]["code"], "context_length_exceeded", "{body}");
    }
}

/// `/tokenize`'s answers to bad `messages` and chat fields: which one, and what it says.
#[tokio::test]
async fn tokenize_message_errors_name_the_field() {
    let s = server(Options::default());
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"messages": [{"role": 5}]}), "messages[0].role", "field `messages[0].role`: invalid type: integer `5`, expected a string"),
        // The message's type is checked before `prompt` and `messages` are found both sent.
        (json!({"prompt": "x", "messages": [{"role": 5}]}), "messages[0].role", "field `messages[0].role`: invalid type: integer `5`, expected a string"),
        (json!({"prompt": "x", "messages": user}), "prompt", "send exactly one of `prompt` and `messages`"),
        (json!({"messages": []}), "messages", "messages must contain at least one message"),
        // Any other role reaches the template (vLLM's rule); only an empty one is refused.
        (json!({"messages": [{"role": "", "content": "x"}]}), "messages[0].role", "messages[0].role must not be empty"),
        (json!({"messages": user, "add_special_tokens": true}), "add_special_tokens", "`add_special_tokens: true` with `messages` is not supported: the chat template writes the special tokens"),
        // Chat's own fields are read as chat reads them.
        (json!({"messages": user, "logprobs": "yes"}), "logprobs", "field `logprobs`: invalid type: string \"yes\", expected a boolean"),
        (json!({"messages": user, "continue_final_message": true}), "continue_final_message", "Cannot set both `continue_final_message` and `add_generation_prompt` to true; set `add_generation_prompt: false`"),
        (json!({"messages": user, "tools": {}}), "tools", "tools must be a list of function tools"),
    ];
    for (body, param, message) in cases {
        let r = s.post("/tokenize", body.clone()).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text);
        let e = &r.json()["error"];
        assert_eq!((e["param"].as_str(), e["message"].as_str()), (Some(param), Some(message)), "{body}");
    }
}
