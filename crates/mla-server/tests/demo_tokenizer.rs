//! The demo tokenizer through `TextTokenizer`, against transformers' encodings and decodings
//! (tests/fixtures/templates/demo_tokenizer.json) and the demo model's config.

use crate::common;

use common::{demo_dir, demo_tokenizer, read_json, template_fixtures_dir};
use mla_server::chat_template::{ChatTemplate, RenderOptions};
use serde_json::{json, Value};

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn encodings_match_transformers() {
    let fixture = read_json(template_fixtures_dir().join("demo_tokenizer.json"));
    let tokenizer = demo_tokenizer();
    for case in fixture["encodings"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tokenizer.encode(text, true).unwrap(),
            ids(&case["with_special_tokens"]),
            "{text:?} with special tokens"
        );
        assert_eq!(tokenizer.encode(text, false).unwrap(), ids(&case["without_special_tokens"]), "{text:?} without");
    }
}

#[test]
fn decodings_match_transformers_with_and_without_special_tokens() {
    let fixture = read_json(template_fixtures_dir().join("demo_tokenizer.json"));
    let tokenizer = demo_tokenizer();
    for case in fixture["decodings"].as_array().unwrap() {
        let token_ids = ids(&case["ids"]);
        assert_eq!(
            tokenizer.decode(&token_ids, true).unwrap(),
            case["skip_special_tokens"].as_str().unwrap(),
            "{token_ids:?} skipping"
        );
        assert_eq!(
            tokenizer.decode(&token_ids, false).unwrap(),
            case["keep_special_tokens"].as_str().unwrap(),
            "{token_ids:?} keeping"
        );
    }
}

#[test]
fn skip_special_tokens_removes_special_but_keeps_tool_markers() {
    let tokenizer = demo_tokenizer();
    let text = "<｜User｜>Hi<｜Assistant｜><｜tool▁call▁begin｜>f<｜end▁of▁sentence｜>";
    let token_ids = tokenizer.encode(text, false).unwrap();
    assert_eq!(tokenizer.decode(&token_ids, false).unwrap(), text);
    assert_eq!(tokenizer.decode(&token_ids, true).unwrap(), "Hi<｜tool▁call▁begin｜>f");
}

#[test]
fn special_flags_follow_tokenizer_json() {
    // Independent reading of tokenizer.json's added_tokens.
    let raw = read_json(demo_dir().join("tokenizer.json"));
    let tokenizer = demo_tokenizer();
    let added = raw["added_tokens"].as_array().unwrap();
    assert_eq!(added.len(), 14);
    for token in added {
        let id = token["id"].as_u64().unwrap() as u32;
        assert_eq!(tokenizer.is_special(id), token["special"].as_bool().unwrap(), "{}", token["content"]);
        assert_eq!(tokenizer.token_to_id(token["content"].as_str().unwrap()), Some(id));
    }
    assert!(!tokenizer.is_special(300), "an ordinary BPE token");
}

#[test]
fn sizes_and_named_tokens_match_transformers() {
    let fixture = read_json(template_fixtures_dir().join("demo_tokenizer.json"));
    let tokenizer = demo_tokenizer();
    assert_eq!(tokenizer.vocab_size(), 512);
    assert_eq!(fixture["vocab_size"], 512);
    let bos = tokenizer.bos().unwrap();
    let eos = tokenizer.eos().unwrap();
    assert_eq!(json!([bos.text, bos.id]), fixture["bos"]);
    assert_eq!(json!([eos.text, eos.id]), fixture["eos"]);
    assert_eq!(tokenizer.config().add_bos_token, Some(true));
}

#[test]
fn chat_prompt_gets_exactly_one_bos() {
    let tokenizer = demo_tokenizer();
    let template = ChatTemplate::new(tokenizer.config().chat_templates.select(None, false).unwrap()).unwrap();
    let messages = vec![json!({"role": "user", "content": "Hello"})];
    let options = RenderOptions {
        add_generation_prompt: true,
        special_tokens: tokenizer.template_special_tokens(),
        ..Default::default()
    };
    let rendered = template.render(&messages, &options).unwrap();
    let bos = tokenizer.bos().unwrap().id;
    assert!(rendered.starts_with(&tokenizer.bos().unwrap().text), "the template writes BOS");

    let prompt = tokenizer.encode_chat_prompt(&rendered).unwrap();
    assert_eq!(prompt.iter().filter(|&&id| id == bos).count(), 1, "{prompt:?}");
    assert_eq!(prompt[0], bos);
    // What the tokenizer would do on its own: a second BOS. This is why chat prompts skip it.
    let doubled = tokenizer.encode(&rendered, true).unwrap();
    assert_eq!(&doubled[..2], &[bos, bos]);
}

#[test]
fn demo_config_agrees_with_the_tokenizer() {
    let config = mla_core::model::config::ModelConfig::from_file(&demo_dir().join("config.json")).unwrap();
    let tokenizer = demo_tokenizer();
    assert_eq!(config.vocab_size, tokenizer.vocab_size());
    assert_eq!(config.bos_token_id, Some(tokenizer.bos().unwrap().id));
    assert_eq!(config.eos_token_ids, vec![tokenizer.eos().unwrap().id]);
    assert_eq!(config.model_type, mla_core::model::config::ModelType::DeepseekV3);
    assert_eq!(
        (config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim),
        (64, 16, 32, 32)
    );
    assert_eq!((config.n_routed_experts, config.num_hidden_layers), (8, 2));
    assert!(config.q_lora_rank.is_some());
    assert!(matches!(config.rope_scaling, mla_core::model::rope::RopeScaling::Yarn(_)));
}
