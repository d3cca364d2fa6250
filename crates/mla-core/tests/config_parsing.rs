//! Config parsing: every preset and fixture parses with the published values, the transformers 5
//! `rope_parameters` form means the same model as `rope_scaling`, and bad configs fail naming the
//! field and the value.

use mla_core::model::config::{ModelConfig, ModelType, ScoringFunc, TopkMethod};
use mla_core::model::rope::RopeScaling;
use serde_json::{json, Value};
use std::path::PathBuf;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn preset(name: &str) -> Value {
    let text = std::fs::read_to_string(repo().join("configs").join(format!("{name}.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn parse(v: &Value) -> Result<ModelConfig, mla_core::ConfigError> {
    ModelConfig::from_json_str(&v.to_string(), "test.json")
}

#[test]
fn every_preset_and_fixture_config_parses() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    for dir in std::fs::read_dir(repo().join("tests/fixtures")).unwrap() {
        let p = dir.unwrap().path().join("config.json");
        if p.exists() {
            files.push(p);
        }
    }
    assert!(files.len() >= 5, "expected presets and fixtures, found {files:?}");
    for f in files {
        ModelConfig::from_file(&f).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn published_values_are_read() {
    let lite = parse(&preset("deepseek-v2-lite")).unwrap();
    assert_eq!(lite.model_type, ModelType::DeepseekV2);
    assert_eq!(lite.q_lora_rank, None);
    assert_eq!((lite.n_routed_experts, lite.num_experts_per_tok, lite.n_shared_experts), (64, 6, 2));
    assert_eq!(lite.topk_method, TopkMethod::Greedy);
    assert_eq!(lite.eos_token_ids, vec![100001]);
    assert_eq!(lite.bos_token_id, Some(100000));

    let v25 = parse(&preset("deepseek-v2.5")).unwrap();
    assert_eq!(v25.topk_method, TopkMethod::GroupLimitedGreedy);
    assert_eq!((v25.n_group, v25.topk_group), (8, 3));
    assert_eq!(v25.routed_scaling_factor, 16.0);

    let v3 = parse(&preset("deepseek-v3")).unwrap();
    assert_eq!(v3.model_type, ModelType::DeepseekV3);
    assert_eq!((v3.topk_method, v3.scoring_func), (TopkMethod::NoauxTc, ScoringFunc::Sigmoid));
    assert!(v3.norm_topk_prob);
    assert_eq!(v3.q_lora_rank, Some(1536));
    assert_eq!(v3.quantization.unwrap().block, [128, 128]);
    assert_eq!(v3.num_nextn_predict_layers, 1);
    assert_eq!(v3.first_k_dense_replace, 3);
    assert!(!v3.is_moe_layer(2) && v3.is_moe_layer(3));
    // V3: mscale_all_dim 1.0, factor 40 -> (0.1 ln 40 + 1)^2 / sqrt(192).
    let m = 0.1 * 40f64.ln() + 1.0;
    assert!((v3.softmax_scale() - m * m / 192f64.sqrt()).abs() < 1e-12);
    match v3.rope_scaling {
        RopeScaling::Yarn(y) => {
            assert_eq!((y.factor, y.original_max_position_embeddings), (40.0, 4096));
        }
        RopeScaling::None => panic!("V3 uses YaRN"),
    }
}

#[test]
fn rope_parameters_form_is_the_same_model() {
    // transformers 5 writes rope_theta inside rope_parameters with rope_type.
    let mut v = preset("deepseek-v2-lite");
    let obj = v.as_object_mut().unwrap();
    let mut params = obj.remove("rope_scaling").unwrap();
    let theta = obj.remove("rope_theta").unwrap();
    let p = params.as_object_mut().unwrap();
    p.remove("type");
    p.insert("rope_type".into(), json!("yarn"));
    p.insert("rope_theta".into(), theta);
    obj.insert("rope_parameters".into(), params);
    assert_eq!(parse(&v).unwrap(), parse(&preset("deepseek-v2-lite")).unwrap());
}

fn expect_error(mutate: impl FnOnce(&mut serde_json::Map<String, Value>), field: &str, needle: &str) {
    let mut v = preset("deepseek-v3");
    mutate(v.as_object_mut().unwrap());
    let err = parse(&v).expect_err("config should be rejected");
    let msg = err.to_string();
    assert_eq!(err.field, field, "{msg}");
    assert!(msg.contains("test.json"), "{msg}");
    assert!(msg.contains(needle), "{msg} should mention {needle}");
}

#[test]
fn bad_configs_name_the_file_field_and_value() {
    expect_error(
        |o| {
            o.insert("model_type".into(), json!("llama"));
        },
        "model_type",
        "\"llama\"",
    );
    expect_error(
        |o| {
            o.insert("topk_method".into(), json!("random"));
        },
        "topk_method",
        "\"random\"",
    );
    expect_error(
        |o| {
            o.insert("rope_scaling".into(), json!({"type": "linear", "factor": 2}));
        },
        "rope_scaling.type",
        "\"linear\"",
    );
    expect_error(
        |o| {
            o.insert("scoring_func".into(), json!("softmax"));
        },
        "topk_method",
        "combination",
    );
    expect_error(
        |o| {
            o.remove("kv_lora_rank");
        },
        "kv_lora_rank",
        "missing",
    );
    expect_error(
        |o| {
            o.insert("hidden_size".into(), json!("big"));
        },
        "hidden_size",
        "\"big\"",
    );
    expect_error(
        |o| {
            o.insert("num_key_value_heads".into(), json!(1));
        },
        "num_key_value_heads",
        "1",
    );
    expect_error(
        |o| {
            o.insert("n_group".into(), json!(7));
        },
        "n_group",
        "7",
    );
    expect_error(
        |o| {
            o.insert("moe_layer_freq".into(), json!(2));
        },
        "moe_layer_freq",
        "2",
    );
    expect_error(
        |o| {
            o.insert("hidden_act".into(), json!("gelu"));
        },
        "hidden_act",
        "\"gelu\"",
    );
    expect_error(
        |o| {
            o.insert("quantization_config".into(), json!({"quant_method": "awq"}));
        },
        "quantization_config.quant_method",
        "\"awq\"",
    );
    expect_error(
        |o| {
            o.insert("num_experts_per_tok".into(), json!(300));
        },
        "num_experts_per_tok",
        "300",
    );
}

#[test]
fn unreadable_or_invalid_files_are_named() {
    let err = ModelConfig::from_file(&repo().join("configs/no-such-model.json")).unwrap_err();
    assert!(err.to_string().contains("no-such-model.json"), "{err}");
    let err = ModelConfig::from_json_str("{not json", "broken.json").unwrap_err();
    assert!(err.to_string().contains("broken.json") && err.to_string().contains("JSON"), "{err}");
}
