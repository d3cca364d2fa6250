//! Helpers shared by the mla-cpu integration tests: small configs, plan builders, comparisons.
#![allow(dead_code)]

use mla_core::step::plan::{LogitsRequest, SeqStep, StepKind, StepPlan};
use mla_core::{Backend, DummyWeights, ModelConfig};
use mla_cpu::CpuBackend;
use std::path::PathBuf;

/// V2-Lite-shaped: direct query, greedy softmax routing, two shared experts, YaRN with mscales.
pub const V2_LITE_LIKE: &str = r#"{
  "model_type": "deepseek_v2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
  "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": null, "kv_lora_rank": 32,
  "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 512,
  "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 2,
  "first_k_dense_replace": 1, "topk_method": "greedy", "rms_norm_eps": 1e-6, "rope_theta": 10000,
  "rope_scaling": {"type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                   "mscale_all_dim": 0.707, "original_max_position_embeddings": 64}
}"#;

/// V3-shaped: low-rank query, noaux_tc with groups and bias, normalised top-k, scaling 2.5.
pub const V3_LIKE: &str = r#"{
  "model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
  "num_hidden_layers": 3, "num_attention_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32,
  "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 512,
  "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 16, "n_shared_experts": 1,
  "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "norm_topk_prob": true,
  "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "rope_theta": 10000,
  "rope_scaling": {"type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}
}"#;

/// V2-shaped with group-limited routing and tied embeddings, no shared experts, no YaRN.
pub const V2_GROUPED_TIED: &str = r#"{
  "model_type": "deepseek_v2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
  "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
  "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "max_position_embeddings": 512,
  "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 16, "n_shared_experts": 0,
  "first_k_dense_replace": 0, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
  "routed_scaling_factor": 16.0, "tie_word_embeddings": true
}"#;

pub fn config(json: &str) -> ModelConfig {
    ModelConfig::from_json_str(json, "test config").unwrap()
}

pub fn dummy_backend(json: &str, block_size: usize, num_blocks: usize) -> CpuBackend {
    CpuBackend::new(config(json), &DummyWeights::new(42), block_size, num_blocks).unwrap()
}

/// A deterministic token sequence inside the vocabulary.
pub fn tokens(n: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 17 + salt * 31 + 5) % vocab).collect()
}

pub fn seq(seq_id: u64, tokens: &[u32], context_len: usize, block_table: &[u32]) -> SeqStep {
    SeqStep {
        fork: None,
        seq_id,
        tokens: tokens.to_vec(),
        context_len,
        block_table: block_table.to_vec(),
        logits: LogitsRequest::All,
        sample: None,
        mtp: None,
    }
}

/// Runs one step and returns every sequence's logits rows.
pub fn step(b: &mut CpuBackend, kind: StepKind, seqs: Vec<SeqStep>) -> Vec<Vec<Vec<f32>>> {
    let out = b.step(&StepPlan { kind, seqs }).unwrap();
    out.seqs.into_iter().map(|s| s.logits).collect()
}

/// Prefills `prompt` in one piece, then decodes `cont` one token at a time (absorbed path);
/// returns the logits of every fed token in order.
pub fn prefill_then_decode(b: &mut CpuBackend, prompt: &[u32], cont: &[u32], table: &[u32]) -> Vec<Vec<f32>> {
    let mut rows = step(b, StepKind::Prefill, vec![seq(1, prompt, 0, table)]).remove(0);
    for (j, &t) in cont.iter().enumerate() {
        rows.extend(step(b, StepKind::Decode, vec![seq(1, &[t], prompt.len() + j, table)]).remove(0));
    }
    rows
}

pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "row counts differ");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "row widths differ");
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

/// Largest absolute logit, to show the comparisons are not between near-zero numbers.
pub fn max_abs(rows: &[Vec<f32>]) -> f32 {
    rows.iter().flatten().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// One prompt of an HF fixture with HF's continuation and logits.
pub struct Prompt {
    pub name: String,
    pub prompt: Vec<u32>,
    pub continuation: Vec<u32>,
    pub gaps: Vec<f32>,
    /// HF logits rows, `[prompt + continuation][vocab]`.
    pub oracle: Vec<Vec<f32>>,
}

pub fn fixture_dir(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(variant)
}

pub fn load_prompts(dir: &std::path::Path, vocab: usize) -> Vec<Prompt> {
    let oracle: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("oracle.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("oracle_f32.safetensors")).unwrap();
    let logits = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    oracle["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let name = p["name"].as_str().unwrap().to_string();
            let t = logits.tensor(&name).unwrap();
            assert_eq!(t.dtype(), safetensors::Dtype::F32);
            let values: Vec<f32> =
                t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let (prompt, continuation) = (ids(&p["prompt"]), ids(&p["continuation"]));
            assert_eq!(t.shape(), [prompt.len() + continuation.len(), vocab]);
            Prompt {
                name,
                prompt,
                continuation,
                gaps: p["gaps"].as_array().unwrap().iter().map(|g| g.as_f64().unwrap() as f32).collect(),
                oracle: values.chunks(vocab).map(|r| r.to_vec()).collect(),
            }
        })
        .collect()
}

/// One teacher-forced sequence of an MTP fixture's oracle (tests/fixtures/v3_mtp*,
/// scripts/make_mtp_fixture.py).
pub struct MtpOracle {
    pub name: String,
    /// Prompt and continuation.
    pub tokens: Vec<u32>,
    /// `[len, hidden]`: HF's last hidden state per position.
    pub hidden: Vec<f32>,
    /// `[len - 1][vocab]`: row i drafts the token at i + 2.
    pub draft: Vec<Vec<f32>>,
}

/// A CPU backend over an MTP fixture, with its MTP layer loaded when `mtp`.
pub fn mtp_backend(
    cfg: &ModelConfig,
    ckpt: &mla_core::Checkpoint,
    block_size: usize,
    blocks: usize,
    mtp: bool,
) -> CpuBackend {
    let b = CpuBackend::new(cfg.clone(), ckpt, block_size, blocks).unwrap();
    if mtp {
        b.with_mtp(ckpt).unwrap()
    } else {
        b
    }
}

/// An MTP fixture's config, checkpoint and oracle sequences (short, medium, long).
pub fn mtp_oracles(variant: &str) -> (ModelConfig, mla_core::Checkpoint, Vec<MtpOracle>) {
    let dir = fixture_dir(variant);
    assert!(dir.is_dir(), "{variant}: fixture {} is absent (scripts/make_mtp_fixture.py)", dir.display());
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = mla_core::Checkpoint::open(&dir, &cfg).unwrap();
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("oracle_mtp.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("oracle_mtp_f32.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| -> (Vec<usize>, Vec<f32>) {
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        (t.shape().to_vec(), t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
    };
    let list: Vec<MtpOracle> = record["prompts"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, p)| {
            let tokens: Vec<u32> = p["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
            let (_, hidden) = f32s(&format!("{name}.hidden"));
            let (shape, flat) = f32s(&format!("{name}.draft_logits"));
            assert_eq!(shape, vec![tokens.len() - 1, cfg.vocab_size]);
            let draft = flat.chunks(cfg.vocab_size).map(<[f32]>::to_vec).collect();
            MtpOracle { name: name.clone(), tokens, hidden, draft }
        })
        .collect();
    assert_eq!(list.len(), 3, "short, medium and long");
    (cfg, ckpt, list)
}
