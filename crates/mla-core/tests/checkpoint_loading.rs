//! Checkpoint reading against tiny safetensors files written here: every error names what is
//! wrong, sharded and single-file checkpoints read the same values, FP8 weights dequantize.

use mla_core::model::weight_source::WeightSource;
use mla_core::{
    Checkpoint, CheckpointError, DummyWeights, ModelConfig, ModelSpec, Parallel, Shard, TensorRole, TensorSpec,
};
use safetensors::tensor::{Dtype, TensorView};
use std::path::{Path, PathBuf};

const TINY: &str = r#"{
  "model_type": "deepseek_v2", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 12,
  "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": null, "kv_lora_rank": 4,
  "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4, "max_position_embeddings": 64,
  "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6,
  "n_shared_experts": 1, "first_k_dense_replace": 1, "topk_method": "greedy"
}"#;

fn tiny_config() -> ModelConfig {
    ModelConfig::from_json_str(TINY, "tiny").unwrap()
}

fn fp8_config() -> ModelConfig {
    let mut v: serde_json::Value = serde_json::from_str(TINY).unwrap();
    v["quantization_config"] = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [2, 2]});
    ModelConfig::from_json_str(&v.to_string(), "tiny-fp8").unwrap()
}

/// A fresh empty directory for one test.
fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mla-core-ckpt-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

struct Raw {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect()
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Every tensor of `cfg` in bf16 with dummy values.
fn model_tensors(cfg: &ModelConfig) -> Vec<Raw> {
    let src = DummyWeights::new(3);
    ModelSpec::new(cfg)
        .tensors()
        .into_iter()
        .map(|t| Raw {
            name: t.name.clone(),
            dtype: Dtype::BF16,
            shape: t.shape.clone(),
            bytes: bf16_bytes(&src.read_f32(t).unwrap()),
        })
        .collect()
}

fn write_file(path: &Path, tensors: &[Raw]) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|r| (r.name.clone(), TensorView::new(r.dtype, r.shape.clone(), &r.bytes).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn write_single(dir: &Path, tensors: &[Raw]) {
    write_file(&dir.join("model.safetensors"), tensors);
}

fn open_err(dir: &Path, cfg: &ModelConfig) -> String {
    match Checkpoint::open(dir, cfg) {
        Ok(_) => panic!("{} opened although it should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn read_err(ckpt: &Checkpoint, spec: &TensorSpec) -> String {
    match ckpt.read_f32(spec) {
        Ok(_) => panic!("reading {} succeeded although it should not", spec.name),
        Err(e) => e.to_string(),
    }
}

fn find_spec(cfg: &ModelConfig, name: &str) -> TensorSpec {
    ModelSpec::new(cfg).tensors().into_iter().find(|t| t.name == name).unwrap().clone()
}

#[test]
fn complete_single_file_reads_back_exact_bf16_values() {
    let cfg = tiny_config();
    let dir = temp_dir("complete");
    let mut tensors = model_tensors(&cfg);
    // An unused extra tensor (like V3's MTP layer) must be ignored.
    tensors.push(Raw {
        name: "model.layers.2.extra.weight".into(),
        dtype: Dtype::F32,
        shape: vec![2],
        bytes: f32_bytes(&[1.0, 2.0]),
    });
    write_single(&dir, &tensors);
    let ckpt = Checkpoint::open(&dir, &cfg).unwrap();
    let dummy = DummyWeights::new(3);
    for spec in ModelSpec::new(&cfg).tensors() {
        let want: Vec<f32> = dummy.read_f32(spec).unwrap().iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect();
        assert_eq!(ckpt.read_f32(spec).unwrap(), want, "{}", spec.name);
        let bits: Vec<u16> = want.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
        assert_eq!(ckpt.read_bf16_bits(spec).unwrap(), bits, "{}", spec.name);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rank's share cut from the mapped file equals the whole tensor read and cut, for every
/// tensor and rank of TP 2 and DP attention 2.
#[test]
fn shards_cut_from_the_file_equal_the_whole_tensor_cut() {
    let cfg = tiny_config();
    let dir = temp_dir("shards");
    write_single(&dir, &model_tensors(&cfg));
    let ckpt = Checkpoint::open(&dir, &cfg).unwrap();
    let mut cut = 0;
    for dpa in [false, true] {
        let par = Parallel::from_flags(2, None, dpa).unwrap();
        for rank in 0..2 {
            for spec in ModelSpec::new(&cfg).tensors() {
                let part = par.rank(rank).shard(spec);
                let whole = ckpt.read_bf16_bits(spec).unwrap();
                let got = ckpt.read_bf16_bits_shard(spec, &part).unwrap();
                assert_eq!(got, part.take(&whole, &spec.shape), "{} rank {rank} {part:?}", spec.name);
                cut += usize::from(part != Shard::Whole);
            }
        }
    }
    assert!(cut > 20, "the model has sharded tensors to cut ({cut})");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let cfg = tiny_config();
    let dir = temp_dir("missing-tensor");
    let gone = "model.layers.1.mlp.experts.3.up_proj.weight";
    let tensors: Vec<Raw> = model_tensors(&cfg).into_iter().filter(|r| r.name != gone).collect();
    write_single(&dir, &tensors);
    let ckpt = Checkpoint::open(&dir, &cfg).unwrap();
    let msg = read_err(&ckpt, &find_spec(&cfg, gone));
    assert!(msg.contains(&format!("tensor `{gone}` is missing from")) && msg.contains("model.safetensors"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn wrong_shape_names_expected_and_found() {
    let cfg = tiny_config();
    let dir = temp_dir("wrong-shape");
    let name = "model.layers.0.self_attn.kv_b_proj.weight";
    let mut tensors = model_tensors(&cfg);
    let t = tensors.iter_mut().find(|r| r.name == name).unwrap();
    t.shape = vec![4, 16]; // transposed: [kv_lora_rank, heads * (nope + v)]
    write_single(&dir, &tensors);
    let ckpt = Checkpoint::open(&dir, &cfg).unwrap();
    let msg = read_err(&ckpt, &find_spec(&cfg, name));
    assert!(msg.contains(name) && msg.contains("shape [4, 16], expected [16, 4]"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn wrong_dtype_names_expected_kinds_and_found() {
    let cfg = tiny_config();
    let dir = temp_dir("wrong-dtype");
    let mut tensors = model_tensors(&cfg);
    let norm = tensors.iter_mut().find(|r| r.name == "model.norm.weight").unwrap();
    norm.dtype = Dtype::I16; // same byte size as bf16, so the file itself is valid
                             // FP8 is only acceptable for linear weights, never for the router.
    let router = tensors.iter_mut().find(|r| r.name == "model.layers.1.mlp.gate.weight").unwrap();
    router.dtype = Dtype::F8_E4M3;
    router.bytes.truncate(router.bytes.len() / 2);
    write_single(&dir, &tensors);
    let ckpt = Checkpoint::open(&dir, &cfg).unwrap();
    let msg = read_err(&ckpt, &find_spec(&cfg, "model.norm.weight"));
    assert!(msg.contains("`model.norm.weight`") && msg.contains("dtype I16, expected BF16, F16 or F32"), "{msg}");
    let msg = read_err(&ckpt, &find_spec(&cfg, "model.layers.1.mlp.gate.weight"));
    assert!(
        msg.contains("`model.layers.1.mlp.gate.weight`") && msg.contains("dtype F8_E4M3, expected BF16, F16 or F32"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_file_names_both_layouts() {
    let dir = temp_dir("no-files");
    let msg = open_err(&dir, &tiny_config());
    assert!(msg.contains("no model.safetensors and no model.safetensors.index.json"), "{msg}");
    assert!(msg.contains(&dir.display().to_string()), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Splits the model over two shards and writes an index for them.
fn write_sharded(dir: &Path, cfg: &ModelConfig, index_extra: &[(&str, &str)]) {
    let tensors = model_tensors(cfg);
    let (a, b): (Vec<Raw>, Vec<Raw>) = tensors.into_iter().partition(|r| !r.name.starts_with("model.layers.1."));
    write_file(&dir.join("model-00001-of-00002.safetensors"), &a);
    write_file(&dir.join("model-00002-of-00002.safetensors"), &b);
    let mut map = serde_json::Map::new();
    for r in &a {
        map.insert(r.name.clone(), "model-00001-of-00002.safetensors".into());
    }
    for r in &b {
        map.insert(r.name.clone(), "model-00002-of-00002.safetensors".into());
    }
    for (k, v) in index_extra {
        map.insert(k.to_string(), (*v).into());
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn sharded_checkpoint_reads_like_single_file() {
    let cfg = tiny_config();
    let dir = temp_dir("sharded");
    write_sharded(&dir, &cfg, &[]);
    let ckpt = Checkpoint::open(&dir, &cfg).unwrap();
    let dummy = DummyWeights::new(3);
    for spec in ModelSpec::new(&cfg).tensors() {
        let want: Vec<f32> = dummy.read_f32(spec).unwrap().iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect();
        assert_eq!(ckpt.read_f32(spec).unwrap(), want, "{}", spec.name);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sharded_index_pointing_to_a_missing_shard_is_named() {
    let cfg = tiny_config();
    let dir = temp_dir("missing-shard");
    write_sharded(&dir, &cfg, &[("lm_head.weight", "model-00003-of-00003.safetensors")]);
    let msg = open_err(&dir, &cfg);
    assert!(
        msg.contains("model.safetensors.index.json")
            && msg.contains("maps tensor `lm_head.weight` to shard")
            && msg.contains("model-00003-of-00003.safetensors, which does not exist"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tensor_absent_from_index_is_named_with_the_index() {
    let cfg = tiny_config();
    let dir = temp_dir("index-entry");
    write_sharded(&dir, &cfg, &[]);
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"].as_object_mut().unwrap().remove("model.layers.0.self_attn.o_proj.weight");
    std::fs::write(&index_path, index.to_string()).unwrap();
    let ckpt = Checkpoint::open(&dir, &cfg).unwrap();
    let msg = read_err(&ckpt, &find_spec(&cfg, "model.layers.0.self_attn.o_proj.weight"));
    assert!(
        msg.contains("tensor `model.layers.0.self_attn.o_proj.weight` is missing from")
            && msg.contains("model.safetensors.index.json"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn fp8_weight_spec() -> TensorSpec {
    TensorSpec::new("w.weight".into(), vec![3, 5], TensorRole::Linear)
}

/// The hand-computed case of `fp8::tests`, through a file: a 3x5 weight with 2x2 blocks.
fn write_fp8_case(dir: &Path, scale_shape: Vec<usize>) {
    let data: Vec<u8> = vec![
        0x38, 0x40, 0x38, 0x38, 0x3c, //
        0xb8, 0x00, 0x40, 0x38, 0x38, //
        0x38, 0x38, 0x38, 0xb8, 0x40,
    ];
    let scales = [0.5f32, 2.0, 10.0, -1.0, 3.0, 0.25];
    write_single(
        dir,
        &[
            Raw { name: "w.weight".into(), dtype: Dtype::F8_E4M3, shape: vec![3, 5], bytes: data },
            Raw { name: "w.weight_scale_inv".into(), dtype: Dtype::F32, shape: scale_shape, bytes: f32_bytes(&scales) },
        ],
    );
}

#[test]
fn fp8_weight_dequantizes_with_its_block_scales() {
    let dir = temp_dir("fp8");
    write_fp8_case(&dir, vec![2, 3]);
    let ckpt = Checkpoint::open(&dir, &fp8_config()).unwrap();
    let spec = fp8_weight_spec();
    let expected = [
        0.5, 1.0, 2.0, 2.0, 15.0, //
        -0.5, 0.0, 4.0, 2.0, 10.0, //
        -1.0, -1.0, 3.0, -3.0, 0.5,
    ];
    assert_eq!(ckpt.read_f32(&spec).unwrap(), expected);
    let raw = ckpt.read_fp8(&spec).unwrap().expect("stored as fp8");
    assert_eq!((raw.rows, raw.cols, raw.block, raw.scale_inv.len()), (3, 5, [2, 2], 6));
    let bits: Vec<u16> = expected.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
    assert_eq!(ckpt.read_bf16_bits(&spec).unwrap(), bits);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fp8_scale_problems_are_named() {
    let dir = temp_dir("fp8-bad-scale");
    write_fp8_case(&dir, vec![3, 2]);
    let ckpt = Checkpoint::open(&dir, &fp8_config()).unwrap();
    let msg = read_err(&ckpt, &fp8_weight_spec());
    assert!(msg.contains("`w.weight_scale_inv`") && msg.contains("shape [3, 2], expected [2, 3]"), "{msg}");
    // The same file under a config without quantization_config cannot be interpreted.
    let ckpt = Checkpoint::open(&dir, &tiny_config()).unwrap();
    let msg = read_err(&ckpt, &fp8_weight_spec());
    assert!(msg.contains("`w.weight`") && msg.contains("no quantization_config"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fp8_weight_without_scale_is_named() {
    let dir = temp_dir("fp8-no-scale");
    write_single(
        &dir,
        &[Raw { name: "w.weight".into(), dtype: Dtype::F8_E4M3, shape: vec![3, 5], bytes: vec![0x38; 15] }],
    );
    let ckpt = Checkpoint::open(&dir, &fp8_config()).unwrap();
    let msg = read_err(&ckpt, &fp8_weight_spec());
    assert!(msg.contains("tensor `w.weight_scale_inv` is missing"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn error_variants_are_distinguishable() {
    let dir = temp_dir("variants");
    assert!(matches!(Checkpoint::open(&dir, &tiny_config()), Err(CheckpointError::NoWeightFiles { .. })));
    std::fs::remove_dir_all(&dir).unwrap();
}
