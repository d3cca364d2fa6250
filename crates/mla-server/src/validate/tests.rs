use super::*;
use crate::protocol::common::SamplingWire;
use crate::protocol::parse_fields;
use serde_json::json;

fn wire(v: serde_json::Value) -> SamplingWire {
    parse_fields(&v).unwrap()
}

fn validate(v: serde_json::Value) -> Result<ValidatedParams, ApiError> {
    let max = v.get("max_tokens").and_then(|m| m.as_i64());
    validate_params(wire(v), ("max_tokens", max), None, &GenerationDefaults::default(), &limits())
}

fn param_of(e: ApiError) -> String {
    e.body()["error"]["param"].as_str().unwrap_or_default().to_string()
}

#[test]
fn openai_defaults_when_nothing_is_sent() {
    let p = validate(json!({})).unwrap();
    assert_eq!(p.sampling, SamplingParams::default());
    assert_eq!((p.n, p.max_tokens, p.seed, p.stream, p.include_usage), (1, None, None, false, false));
    assert!(p.skip_special_tokens && !p.ignore_eos && p.stop.is_empty());
}

#[test]
fn out_of_range_values_name_their_field() {
    let cases = [
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"temperature": -0.1}), "temperature"),
        (json!({"top_p": 0.0}), "top_p"),
        (json!({"top_p": 1.01}), "top_p"),
        (json!({"top_k": -2}), "top_k"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"presence_penalty": 2.5}), "presence_penalty"),
        (json!({"frequency_penalty": -3}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"n": 0}), "n"),
        (json!({"n": 129}), "n"),
        (json!({"max_tokens": -1}), "max_tokens"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"stop": ["ok", ""]}), "stop"),
        (json!({"stop": vec!["x"; 65]}), "stop"),
        (json!({"stop": ["y".repeat(1025)]}), "stop"),
        (json!({"stop_token_ids": [512]}), "stop_token_ids"),
        (json!({"stop_token_ids": [-1]}), "stop_token_ids"),
        (json!({"stream_options": {"include_usage": true}}), "stream_options"),
    ];
    for (body, field) in cases {
        let e = validate(body.clone()).expect_err(&body.to_string());
        assert_eq!(e.status().as_u16(), 400, "{body}");
        assert_eq!(param_of(e.clone()), field, "{body}");
        assert!(e.to_string().contains(field), "{body}: {e}");
    }
}

#[test]
fn boundary_values_are_accepted() {
    let p = validate(json!({"temperature": 0, "top_p": 1, "top_k": -1, "min_p": 1, "n": 128,
                            "presence_penalty": -2, "frequency_penalty": 2, "max_tokens": 1}))
    .unwrap();
    assert!(p.sampling.is_greedy());
    assert_eq!(p.sampling.top_k, None);
    assert_eq!((p.n, p.max_tokens), (128, Some(1)));
    let most: Vec<String> = (0..64).map(|i| format!("{i:0>1024}")).collect();
    assert_eq!(validate(json!({"stop": most})).unwrap().stop.len(), 64);
    let p = validate(json!({"stop": "END", "stop_token_ids": [0, 511], "seed": -1, "top_k": 5,
                            "stream": true, "stream_options": {"include_usage": true}}))
    .unwrap();
    assert_eq!(p.stop, vec!["END"]);
    assert_eq!(p.stop_token_ids, vec![0, 511]);
    assert_eq!(p.seed, Some(u64::MAX));
    assert_eq!(p.sampling.top_k, Some(5));
    assert!(p.stream && p.include_usage);
}

#[test]
fn type_errors_are_400_with_the_json_path() {
    let e = parse_fields::<SamplingWire>(&json!({"temperature": "hot"})).unwrap_err();
    assert_eq!(e.status().as_u16(), 400);
    assert_eq!(param_of(e), "temperature");
    let e = parse_fields::<SamplingWire>(&json!({"stream_options": {"include_usage": 3}})).unwrap_err();
    assert_eq!(param_of(e), "stream_options.include_usage");
}

#[test]
fn generation_config_beats_openai_defaults_but_not_the_request() {
    let d = GenerationDefaults { temperature: Some(0.6), top_p: Some(0.95), ..Default::default() };
    let p = validate_params(wire(json!({})), ("max_tokens", None), None, &d, &limits()).unwrap();
    assert_eq!((p.sampling.temperature, p.sampling.top_p), (0.6, 0.95));
    let p = validate_params(wire(json!({"temperature": 0.2})), ("max_tokens", None), None, &d, &limits()).unwrap();
    assert_eq!(p.sampling.temperature, 0.2);
}

#[test]
fn logprob_fields() {
    assert_eq!(chat_logprobs(None, None, &limits()).unwrap(), None);
    assert_eq!(chat_logprobs(Some(true), None, &limits()).unwrap(), Some(0));
    assert_eq!(chat_logprobs(Some(true), Some(5), &limits()).unwrap(), Some(5));
    assert_eq!(param_of(chat_logprobs(Some(false), Some(2), &limits()).unwrap_err()), "top_logprobs");
    assert_eq!(param_of(chat_logprobs(Some(true), Some(21), &limits()).unwrap_err()), "top_logprobs");
    assert_eq!(completion_logprobs(Some(3), &limits()).unwrap(), Some(3));
    assert_eq!(param_of(completion_logprobs(Some(-1), &limits()).unwrap_err()), "logprobs");
    // -1 is the whole vocabulary, allowed once --max-logprobs reaches it (vLLM's rule).
    let wide = ModelLimits { max_logprobs: 512, ..limits() };
    assert_eq!(completion_logprobs(Some(-1), &wide).unwrap(), Some(512));
    assert_eq!(chat_logprobs(Some(true), Some(21), &wide).unwrap(), Some(21));
}

#[test]
fn unsupported_features_are_refused_not_ignored() {
    let u: UnsupportedWire = parse_fields(&json!({"best_of": 2})).unwrap();
    assert_eq!(param_of(refuse_unsupported(&u).unwrap_err()), "best_of");
    let u: UnsupportedWire = parse_fields(&json!({"suffix": "!"})).unwrap();
    assert_eq!(param_of(refuse_unsupported(&u).unwrap_err()), "suffix");
    // Values that ask for nothing special are fine.
    let u: UnsupportedWire =
        parse_fields(&json!({"best_of": 1, "suffix": "", "response_format": {"type": "text"}})).unwrap();
    refuse_unsupported(&u).unwrap();
}

#[test]
fn completions_refuse_tools() {
    let refused = |body: serde_json::Value| refuse_tools(&parse_fields(&body).unwrap()).map_err(param_of);
    assert_eq!(refused(json!({"tools": [{"type": "function"}]})), Err("tools".into()));
    assert_eq!(refused(json!({"functions": [{"name": "f"}]})), Err("tools".into()));
    assert_eq!(refused(json!({"tool_choice": "auto"})), Err("tool_choice".into()));
    assert_eq!(refused(json!({"tools": [], "functions": [], "tool_choice": "none"})), Ok(()));
    // The shared fields, which chat reads too, have no tools among them: chat reads its own.
    let shared = crate::protocol::ignored_fields::field_names::<UnsupportedWire>();
    assert!(["tools", "tool_choice", "functions"].iter().all(|f| !shared.contains(f)), "{shared:?}");
}

fn limits() -> ModelLimits {
    ModelLimits {
        max_model_len: 100,
        vocab_size: 512,
        eos_token_ids: vec![1],
        default_max_new_tokens: None,
        max_logprobs: 20,
    }
}

#[test]
fn context_limits_and_default_max_tokens() {
    let p = validate(json!({})).unwrap();
    let r = limits().engine_request(&p, vec![7; 30], MaxTokensDefault::RestOfContext, "messages").unwrap();
    assert_eq!(r.max_tokens, 70);
    assert_eq!(r.stop_token_ids, vec![1]);
    let r = limits().engine_request(&p, vec![7; 90], MaxTokensDefault::Fixed(16), "prompt").unwrap();
    assert_eq!(r.max_tokens, 10, "the default is cut to what fits");
    let e = limits().engine_request(&p, vec![7; 100], MaxTokensDefault::Fixed(16), "prompt").unwrap_err();
    assert_eq!(e.status().as_u16(), 400);
    let msg = e.to_string();
    assert!(msg.contains("100 tokens") && msg.contains("100 in the prompt"), "{msg}");
    assert_eq!(param_of(e), "prompt");
    // An explicit max_tokens that does not fit is refused, not cut.
    let p = validate(json!({"max_tokens": 71, "ignore_eos": true, "stop_token_ids": [9]})).unwrap();
    let e = limits().engine_request(&p, vec![7; 30], MaxTokensDefault::RestOfContext, "messages").unwrap_err();
    assert!(e.to_string().contains("101"), "{e}");
    let r = limits().engine_request(&p, vec![7; 29], MaxTokensDefault::RestOfContext, "messages").unwrap();
    assert_eq!(r.stop_token_ids, vec![9], "ignore_eos drops the EOS ids but keeps the user's");
    let e = limits().engine_request(&p, vec![], MaxTokensDefault::RestOfContext, "prompt").unwrap_err();
    assert_eq!(param_of(e), "prompt");
}

#[test]
fn generation_config_max_new_tokens_replaces_the_default() {
    let l = ModelLimits { default_max_new_tokens: Some(5), ..limits() };
    let p = validate(json!({})).unwrap();
    let r = l.engine_request(&p, vec![7; 30], MaxTokensDefault::RestOfContext, "messages").unwrap();
    assert_eq!(r.max_tokens, 5);
}

fn params_of(body: serde_json::Value) -> Result<ValidatedParams, ApiError> {
    let w: SamplingWire = parse_fields(&body).unwrap();
    let max = w.max_tokens;
    validate_params(w, ("max_tokens", max), None, &GenerationDefaults::default(), &limits())
}

#[test]
fn logit_bias_is_checked_and_sorted() {
    let p = params_of(json!({"logit_bias": {"7": -100, "3": 2.5}})).unwrap();
    assert_eq!(p.logit_bias, vec![(3, 2.5), (7, -100.0)]);
    for bad in [json!({"7": 1, "007": 2}), json!({"x": 1}), json!({"512": 1}), json!({"-1": 1}), json!({"5": 100.5})] {
        let err = params_of(json!({ "logit_bias": bad })).unwrap_err();
        assert_eq!(param_of(err), "logit_bias", "{bad}");
    }
    // Every key that is not a token id is named, not only the first.
    let err = params_of(json!({"logit_bias": {"bad1": 50, "bad2": 20, "5": 1}})).unwrap_err();
    let message = err.body()["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("\"bad1\"") && message.contains("\"bad2\""), "{message}");
}

#[test]
fn min_tokens_must_fit_max_tokens() {
    assert_eq!(params_of(json!({"min_tokens": 4, "max_tokens": 4})).unwrap().min_tokens, 4);
    assert_eq!(params_of(json!({"min_tokens": 9})).unwrap().min_tokens, 9);
    assert_eq!(param_of(params_of(json!({"min_tokens": 5, "max_tokens": 4})).unwrap_err()), "min_tokens");
    assert_eq!(param_of(params_of(json!({"min_tokens": -1})).unwrap_err()), "min_tokens");
}

#[test]
fn prompt_logprobs_and_usage_options_follow_vllm() {
    let p = validate(json!({"prompt_logprobs": 3, "include_stop_str_in_output": true})).unwrap();
    assert_eq!((p.prompt_logprobs, p.include_stop_str), (Some(3), true));
    assert_eq!(param_of(validate(json!({"prompt_logprobs": 21})).unwrap_err()), "prompt_logprobs");
    assert_eq!(param_of(validate(json!({"prompt_logprobs": -1})).unwrap_err()), "prompt_logprobs");
    // A stream has no place for them; 0 asks for none, so it passes (and computes nothing).
    let streamed = json!({"prompt_logprobs": 1, "stream": true});
    assert_eq!(param_of(validate(streamed).unwrap_err()), "prompt_logprobs");
    assert_eq!(validate(json!({"prompt_logprobs": 0, "stream": true})).unwrap().prompt_logprobs, None);
    // Per-chunk usage only where the final usage is asked for.
    let opts = |o: serde_json::Value| validate(json!({"stream": true, "stream_options": o})).unwrap().continuous_usage;
    assert!(opts(json!({"include_usage": true, "continuous_usage_stats": true})));
    assert!(!opts(json!({"continuous_usage_stats": true})));
}
