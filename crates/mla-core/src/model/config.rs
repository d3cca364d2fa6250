//! Typed, validated DeepSeek model configuration parsed from a HF `config.json`.
//!
//! Every field that changes the math is read explicitly so that an unsupported value is an error
//! naming the file, the field and the value, instead of a silently different model.

use crate::model::rope::{self, RopeScaling, YarnScaling};
use serde_json::{Map, Value};
use std::path::Path;

/// Why a config could not be accepted. The message always names the source, the field and the value.
#[derive(Debug, thiserror::Error)]
#[error("{source_name}: field `{field}`: {message}")]
pub struct ConfigError {
    pub source_name: String,
    pub field: String,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelType {
    DeepseekV2,
    DeepseekV3,
}

/// How the router picks experts (DeepSeek `topk_method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopkMethod {
    /// Plain top-k over softmax scores.
    Greedy,
    /// Keep the `topk_group` groups with the highest max score, then top-k (DeepSeek-V2).
    GroupLimitedGreedy,
    /// Sigmoid scores plus a correction bias used only for choosing; groups ranked by the sum of
    /// their two best biased scores (DeepSeek-V3).
    NoauxTc,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoringFunc {
    Softmax,
    Sigmoid,
}

/// Whether vLLM's `--quantization METHOD` names a method this server implements (only `fp8`).
pub fn check_quantization_method(method: &str) -> Result<(), String> {
    match method {
        "fp8" => Ok(()),
        _ => Err(format!(
            "--quantization {method}: not implemented; `fp8` (block FP8, DeepSeek-V3's format) is the only method"
        )),
    }
}

/// Rows and columns of one scale block of DeepSeek-V3's FP8 checkpoints (`weight_block_size`).
pub const DEEPSEEK_BLOCK: [usize; 2] = [128, 128];

/// FP8 block quantisation of linear weights (DeepSeek-V3 checkpoints).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8BlockQuant {
    /// `[rows, cols]` of one scale block of a `[out, in]` weight.
    pub block: [usize; 2],
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub model_type: ModelType,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub topk_method: TopkMethod,
    pub scoring_func: ScoringFunc,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    pub first_k_dense_replace: usize,
    pub quantization: Option<Fp8BlockQuant>,
    pub num_nextn_predict_layers: usize,
}

impl ModelConfig {
    /// Reads and validates `config.json` (or any file in that format).
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        Self::from_file_with_overrides(path, &Map::new())
    }

    /// Parses config JSON; `source_name` appears in every error (a path or a preset name).
    pub fn from_json_str(text: &str, source_name: &str) -> Result<Self, ConfigError> {
        Self::from_json_str_with_overrides(text, source_name, &Map::new())
    }

    /// `from_file` with `overrides` merged in first (`from_json_str_with_overrides`).
    pub fn from_file_with_overrides(path: &Path, overrides: &Map<String, Value>) -> Result<Self, ConfigError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            source_name: name.clone(),
            field: "<file>".into(),
            message: format!("cannot read: {e}"),
        })?;
        Self::from_json_str_with_overrides(&text, &name, overrides)
    }

    /// Parses config JSON with `overrides` (vLLM's `--hf-overrides`) merged in as a JSON merge
    /// patch (RFC 7396: objects merge field by field, `null` removes a field), then validated
    /// like any config. An override of a field this parser never reads would change nothing, so
    /// it is an error rather than silently ignored.
    pub fn from_json_str_with_overrides(
        text: &str,
        source_name: &str,
        overrides: &Map<String, Value>,
    ) -> Result<Self, ConfigError> {
        let mut value: Value = serde_json::from_str(text).map_err(|e| ConfigError {
            source_name: source_name.into(),
            field: "<json>".into(),
            message: format!("not valid JSON: {e}"),
        })?;
        if !value.is_object() {
            return Err(ConfigError {
                source_name: source_name.into(),
                field: "<json>".into(),
                message: "the top level is not an object".into(),
            });
        }
        let overridden;
        let src = if overrides.is_empty() {
            source_name
        } else {
            crate::model::json_patch::merge_patch(&mut value, &Value::Object(overrides.clone()));
            overridden = format!("{source_name} with --hf-overrides");
            &overridden
        };
        let obj = value.as_object().expect("checked above");
        let reader = Reader { obj, src, read: Default::default() };
        let config = reader.parse()?;
        let read = reader.read.borrow();
        if let Some(unread) = overrides.keys().find(|k| !read.contains(k.as_str())) {
            return Err(ConfigError {
                source_name: "--hf-overrides".into(),
                field: unread.clone(),
                message: "mla-serve does not read this config field, so overriding it would change nothing".into(),
            });
        }
        Ok(config)
    }

    /// Query/key head dimension: `qk_nope_head_dim + qk_rope_head_dim`.
    /// vLLM's `--quantization METHOD`: `fp8` makes the linear weights block-FP8 with DeepSeek's
    /// 128x128 blocks (a checkpoint that already is keeps its own blocks); any other method is
    /// not implemented, and the error says so.
    pub fn apply_quantization_flag(&mut self, method: &str) -> Result<(), String> {
        check_quantization_method(method)?;
        if self.quantization.is_none() {
            self.quantization = Some(Fp8BlockQuant { block: DEEPSEEK_BLOCK });
        }
        Ok(())
    }

    pub fn q_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Values per token per layer in the latent KV cache: `[c_kv ; k_pe]`.
    pub fn kv_cache_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Softmax scale of both attention paths: `q_head_dim^-0.5`, times `mscale²` under YaRN with
    /// `mscale_all_dim` (HF `yarn_apply_mscale`).
    pub fn softmax_scale(&self) -> f64 {
        (self.q_head_dim() as f64).powf(-0.5) * rope::softmax_mscale_squared(&self.rope_scaling)
    }

    /// Whether decoder layer `layer` uses the MoE block (otherwise the dense MLP). `moe_layer_freq`
    /// is refused unless 1 when parsing, so every layer from `first_k_dense_replace` on is MoE.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.n_routed_experts > 0 && layer >= self.first_k_dense_replace
    }

    /// Width of the always-on shared-expert MLP.
    pub fn shared_expert_intermediate_size(&self) -> usize {
        self.moe_intermediate_size * self.n_shared_experts
    }

    /// Multiplier applied to RoPE cos/sin (HF's `attention_scaling`).
    pub fn rope_attention_factor(&self) -> f64 {
        rope::attention_factor(&self.rope_scaling)
    }

    /// Inverse RoPE frequencies for the `qk_rope_head_dim / 2` rotated pairs, YaRN-corrected.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        rope::inv_freq(&self.rope_scaling, self.qk_rope_head_dim, self.rope_theta)
    }
}

struct Reader<'a> {
    obj: &'a Map<String, Value>,
    src: &'a str,
    /// Top-level fields looked at, so an override of a field never read can be refused.
    read: std::cell::RefCell<std::collections::BTreeSet<String>>,
}

impl<'a> Reader<'a> {
    fn err(&self, field: &str, message: impl Into<String>) -> ConfigError {
        ConfigError { source_name: self.src.into(), field: field.into(), message: message.into() }
    }

    fn present(&self, field: &str) -> Option<&'a Value> {
        self.read.borrow_mut().insert(field.to_string());
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn usize_req(&self, field: &str) -> Result<usize, ConfigError> {
        let v = self.present(field).ok_or_else(|| self.err(field, "missing"))?;
        v.as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| self.err(field, format!("expected a non-negative integer, found {v}")))
    }

    fn usize_or(&self, field: &str, default: usize) -> Result<usize, ConfigError> {
        match self.present(field) {
            None => Ok(default),
            Some(_) => self.usize_req(field),
        }
    }

    fn usize_opt(&self, field: &str) -> Result<Option<usize>, ConfigError> {
        match self.present(field) {
            None => Ok(None),
            Some(_) => self.usize_req(field).map(Some),
        }
    }

    fn f64_or(&self, field: &str, default: f64) -> Result<f64, ConfigError> {
        match self.present(field) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.err(field, format!("expected a number, found {v}"))),
        }
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool, ConfigError> {
        match self.present(field) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.err(field, format!("expected true or false, found {v}"))),
        }
    }

    fn str_opt(&self, field: &str) -> Result<Option<&'a str>, ConfigError> {
        match self.present(field) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.err(field, format!("expected a string, found {v}"))),
        }
    }

    fn token_ids(&self, field: &str) -> Result<Vec<u32>, ConfigError> {
        match self.present(field) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|x| {
                    x.as_u64()
                        .map(|t| t as u32)
                        .ok_or_else(|| self.err(field, format!("expected token ids, found {x}")))
                })
                .collect(),
            Some(v) => v
                .as_u64()
                .map(|t| vec![t as u32])
                .ok_or_else(|| self.err(field, format!("expected a token id, found {v}"))),
        }
    }

    fn parse(&self) -> Result<ModelConfig, ConfigError> {
        let model_type = match self.str_opt("model_type")? {
            Some("deepseek_v2") => ModelType::DeepseekV2,
            Some("deepseek_v3") => ModelType::DeepseekV3,
            Some(other) => {
                return Err(self.err(
                    "model_type",
                    format!("unsupported value \"{other}\" (expected \"deepseek_v2\" or \"deepseek_v3\")"),
                ))
            }
            None => return Err(self.err("model_type", "missing")),
        };

        if let Some(act) = self.str_opt("hidden_act")? {
            if act != "silu" {
                return Err(self.err("hidden_act", format!("unsupported value \"{act}\" (only \"silu\")")));
            }
        }
        if self.bool_or("attention_bias", false)? {
            return Err(
                self.err("attention_bias", "unsupported value true (no published DeepSeek model has attention biases)")
            );
        }
        if !self.bool_or("rope_interleave", true)? {
            return Err(self.err("rope_interleave", "unsupported value false (DeepSeek rotates consecutive pairs)"));
        }

        let num_attention_heads = self.usize_req("num_attention_heads")?;
        if let Some(kv_heads) = self.usize_opt("num_key_value_heads")? {
            if kv_heads != num_attention_heads {
                return Err(self.err(
                    "num_key_value_heads",
                    format!("unsupported value {kv_heads}: MLA needs it equal to num_attention_heads ({num_attention_heads})"),
                ));
            }
        }

        let (rope_theta, rope_scaling) = self.parse_rope()?;
        let n_routed_experts = self.usize_or("n_routed_experts", 0)?;
        let topk_method = match self.str_opt("topk_method")?.unwrap_or(match model_type {
            ModelType::DeepseekV2 => "greedy",
            ModelType::DeepseekV3 => "noaux_tc",
        }) {
            "greedy" => TopkMethod::Greedy,
            "group_limited_greedy" => TopkMethod::GroupLimitedGreedy,
            "noaux_tc" => TopkMethod::NoauxTc,
            other => {
                return Err(self.err(
                    "topk_method",
                    format!("unsupported value \"{other}\" (expected greedy, group_limited_greedy or noaux_tc)"),
                ))
            }
        };
        let scoring_func = match self.str_opt("scoring_func")?.unwrap_or(match topk_method {
            TopkMethod::NoauxTc => "sigmoid",
            _ => "softmax",
        }) {
            "softmax" => ScoringFunc::Softmax,
            "sigmoid" => ScoringFunc::Sigmoid,
            other => {
                return Err(
                    self.err("scoring_func", format!("unsupported value \"{other}\" (expected softmax or sigmoid)"))
                )
            }
        };
        // HF transformers (the oracle) implements exactly these pairings; anything else would be a
        // model no reference can check.
        match (model_type, topk_method, scoring_func) {
            (ModelType::DeepseekV2, TopkMethod::Greedy | TopkMethod::GroupLimitedGreedy, ScoringFunc::Softmax) => {}
            (ModelType::DeepseekV3, TopkMethod::NoauxTc, ScoringFunc::Sigmoid) => {}
            (_, _, _) => {
                return Err(self.err(
                    "topk_method",
                    format!(
                        "unsupported combination {:?} / {:?} / {:?}: deepseek_v2 routes with softmax + greedy or group_limited_greedy, deepseek_v3 with sigmoid + noaux_tc",
                        self.str_opt("model_type")?.unwrap_or(""), topk_method, scoring_func
                    ),
                ))
            }
        }
        let norm_topk_prob = self.bool_or("norm_topk_prob", false)?;
        if norm_topk_prob && model_type == ModelType::DeepseekV2 {
            return Err(self.err(
                "norm_topk_prob",
                "unsupported value true for deepseek_v2 (HF transformers never normalises softmax routing weights; no published V2 model sets it)",
            ));
        }
        let moe_layer_freq = self.usize_or("moe_layer_freq", 1)?;
        if moe_layer_freq != 1 {
            return Err(self.err(
                "moe_layer_freq",
                format!("unsupported value {moe_layer_freq} (every published model uses 1, and HF transformers ignores other values)"),
            ));
        }
        let n_group = self.usize_or("n_group", 1)?.max(1);
        let topk_group = self.usize_or("topk_group", n_group)?.max(1);
        let num_experts_per_tok = self.usize_or("num_experts_per_tok", 0)?;

        let quantization = self.parse_quantization()?;

        let cfg = ModelConfig {
            model_type,
            vocab_size: self.usize_req("vocab_size")?,
            hidden_size: self.usize_req("hidden_size")?,
            intermediate_size: self.usize_req("intermediate_size")?,
            num_hidden_layers: self.usize_req("num_hidden_layers")?,
            num_attention_heads,
            q_lora_rank: self.usize_opt("q_lora_rank")?,
            kv_lora_rank: self.usize_req("kv_lora_rank")?,
            qk_nope_head_dim: self.usize_req("qk_nope_head_dim")?,
            qk_rope_head_dim: self.usize_req("qk_rope_head_dim")?,
            v_head_dim: self.usize_req("v_head_dim")?,
            rope_theta,
            rope_scaling,
            max_position_embeddings: self.usize_req("max_position_embeddings")?,
            rms_norm_eps: self.f64_or("rms_norm_eps", 1e-6)?,
            tie_word_embeddings: self.bool_or("tie_word_embeddings", false)?,
            bos_token_id: self.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: self.token_ids("eos_token_id")?,
            n_routed_experts,
            n_shared_experts: self.usize_or("n_shared_experts", 0)?,
            num_experts_per_tok,
            moe_intermediate_size: self.usize_or("moe_intermediate_size", 0)?,
            topk_method,
            scoring_func,
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor: self.f64_or("routed_scaling_factor", 1.0)?,
            first_k_dense_replace: self.usize_or("first_k_dense_replace", 0)?,
            quantization,
            num_nextn_predict_layers: self.usize_or("num_nextn_predict_layers", 0)?,
        };
        self.check_consistency(&cfg)?;
        Ok(cfg)
    }

    fn parse_rope(&self) -> Result<(f64, RopeScaling), ConfigError> {
        // Published checkpoints write `rope_theta` + `rope_scaling`; transformers 5 writes
        // `rope_parameters` holding both.
        let (field, params) = match (self.present("rope_parameters"), self.present("rope_scaling")) {
            (Some(p), _) => ("rope_parameters", Some(p)),
            (None, Some(s)) => ("rope_scaling", Some(s)),
            (None, None) => ("rope_scaling", None),
        };
        let params = match params {
            None => return Ok((self.f64_or("rope_theta", 10000.0)?, RopeScaling::None)),
            Some(Value::Object(m)) => m,
            Some(v) => return Err(self.err(field, format!("expected an object, found {v}"))),
        };
        let sub = Reader { obj: params, src: self.src, read: Default::default() };
        let rope_theta = match sub.present("rope_theta") {
            Some(_) => sub.f64_or("rope_theta", 10000.0).map_err(|e| self.nested(field, e))?,
            None => self.f64_or("rope_theta", 10000.0)?,
        };
        let kind = sub
            .str_opt("rope_type")
            .and_then(|t| match t {
                Some(t) => Ok(Some(t)),
                None => sub.str_opt("type"),
            })
            .map_err(|e| self.nested(field, e))?
            .unwrap_or("default");
        match kind {
            "default" => Ok((rope_theta, RopeScaling::None)),
            "yarn" => {
                let wrap = |e| self.nested(field, e);
                let factor = sub.f64_or("factor", f64::NAN).map_err(wrap)?;
                if !factor.is_finite() {
                    return Err(self.err(&format!("{field}.factor"), "missing (required for yarn)"));
                }
                let opt = |name: &str| -> Result<Option<f64>, ConfigError> {
                    match sub.present(name) {
                        None => Ok(None),
                        Some(_) => sub.f64_or(name, 0.0).map(Some).map_err(|e| self.nested(field, e)),
                    }
                };
                let original = match sub.present("original_max_position_embeddings") {
                    Some(_) => sub.usize_req("original_max_position_embeddings").map_err(wrap)?,
                    None => self.usize_req("max_position_embeddings")?,
                };
                let beta_fast = opt("beta_fast")?.filter(|b| *b != 0.0).unwrap_or(32.0);
                let beta_slow = opt("beta_slow")?.filter(|b| *b != 0.0).unwrap_or(1.0);
                Ok((
                    rope_theta,
                    RopeScaling::Yarn(YarnScaling {
                        factor,
                        beta_fast,
                        beta_slow,
                        mscale: opt("mscale")?,
                        mscale_all_dim: opt("mscale_all_dim")?,
                        original_max_position_embeddings: original,
                        attention_factor: opt("attention_factor")?,
                        truncate: sub.bool_or("truncate", true).map_err(wrap)?,
                    }),
                ))
            }
            other => Err(self
                .err(&format!("{field}.type"), format!("unsupported value \"{other}\" (expected \"yarn\" or none)"))),
        }
    }

    fn nested(&self, parent: &str, e: ConfigError) -> ConfigError {
        ConfigError { field: format!("{parent}.{}", e.field), ..e }
    }

    fn parse_quantization(&self) -> Result<Option<Fp8BlockQuant>, ConfigError> {
        let q = match self.present("quantization_config") {
            None => return Ok(None),
            Some(Value::Object(m)) => m,
            Some(v) => return Err(self.err("quantization_config", format!("expected an object, found {v}"))),
        };
        let sub = Reader { obj: q, src: self.src, read: Default::default() };
        let wrap = |e| self.nested("quantization_config", e);
        let method = sub.str_opt("quant_method").map_err(wrap)?.unwrap_or("");
        if method != "fp8" {
            return Err(self.err(
                "quantization_config.quant_method",
                format!("unsupported value \"{method}\" (only fp8 block quantisation)"),
            ));
        }
        if let Some(fmt) = sub.str_opt("fmt").map_err(wrap)? {
            if fmt != "e4m3" {
                return Err(self.err("quantization_config.fmt", format!("unsupported value \"{fmt}\" (only e4m3)")));
            }
        }
        let block = match sub.present("weight_block_size") {
            Some(Value::Array(a)) if a.len() == 2 && a.iter().all(|x| x.as_u64().is_some_and(|v| v > 0)) => {
                [a[0].as_u64().unwrap() as usize, a[1].as_u64().unwrap() as usize]
            }
            Some(v) => {
                return Err(self.err(
                    "quantization_config.weight_block_size",
                    format!("expected two positive integers, found {v}"),
                ))
            }
            None => {
                return Err(self.err(
                    "quantization_config.weight_block_size",
                    "missing (only block-wise fp8 checkpoints are supported)",
                ))
            }
        };
        Ok(Some(Fp8BlockQuant { block }))
    }

    fn check_consistency(&self, c: &ModelConfig) -> Result<(), ConfigError> {
        let positive = [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("kv_lora_rank", c.kv_lora_rank),
            ("qk_nope_head_dim", c.qk_nope_head_dim),
            ("v_head_dim", c.v_head_dim),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(self.err(name, "must be positive, found 0"));
            }
        }
        if c.qk_rope_head_dim == 0 || !c.qk_rope_head_dim.is_multiple_of(2) {
            return Err(
                self.err("qk_rope_head_dim", format!("must be a positive even number, found {}", c.qk_rope_head_dim))
            );
        }
        if c.q_lora_rank == Some(0) {
            return Err(self.err("q_lora_rank", "must be null or positive, found 0"));
        }
        if c.n_routed_experts > 0 {
            if c.num_experts_per_tok == 0 || c.num_experts_per_tok > c.n_routed_experts {
                return Err(self.err(
                    "num_experts_per_tok",
                    format!(
                        "must be in 1..={} (n_routed_experts), found {}",
                        c.n_routed_experts, c.num_experts_per_tok
                    ),
                ));
            }
            if c.moe_intermediate_size == 0 {
                return Err(self.err("moe_intermediate_size", "must be positive when n_routed_experts > 0"));
            }
            if !c.n_routed_experts.is_multiple_of(c.n_group) {
                return Err(self.err(
                    "n_group",
                    format!("{} does not divide n_routed_experts ({})", c.n_group, c.n_routed_experts),
                ));
            }
            if c.topk_group > c.n_group {
                return Err(self.err("topk_group", format!("{} exceeds n_group ({})", c.topk_group, c.n_group)));
            }
            let per_group = c.n_routed_experts / c.n_group;
            if c.topk_method == TopkMethod::NoauxTc && per_group < 2 {
                return Err(self.err(
                    "n_group",
                    "noaux_tc needs at least two experts per group (groups are ranked by their top-2 sum)",
                ));
            }
            if c.topk_method != TopkMethod::Greedy && c.topk_group * per_group < c.num_experts_per_tok {
                return Err(self.err(
                    "topk_group",
                    format!(
                        "{} groups of {per_group} experts cannot supply num_experts_per_tok = {}",
                        c.topk_group, c.num_experts_per_tok
                    ),
                ));
            }
        }
        if let RopeScaling::Yarn(y) = &c.rope_scaling {
            if y.factor <= 0.0 {
                return Err(self.err("rope_scaling.factor", format!("must be positive, found {}", y.factor)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LITE: &str = include_str!("../../../../configs/deepseek-v2-lite.json");

    #[test]
    fn overrides_change_fields_and_are_validated() {
        let layers = |o: serde_json::Value| {
            let o = o.as_object().unwrap().clone();
            ModelConfig::from_json_str_with_overrides(LITE, "lite", &o).map(|c| c.num_hidden_layers)
        };
        assert_eq!(layers(serde_json::json!({"num_hidden_layers": 3})).unwrap(), 3);
        let e = layers(serde_json::json!({"num_hidden_layers": "six"})).unwrap_err();
        assert_eq!(e.field, "num_hidden_layers");
        assert!(e.source_name.contains("--hf-overrides"), "{e}");
        // Consistency checks see the merged config: more experts per token than experts.
        assert!(layers(serde_json::json!({"num_experts_per_tok": 65})).is_err());
        // A field the parser never reads would change nothing.
        let e = layers(serde_json::json!({"no_such_field": 1})).unwrap_err();
        assert_eq!((e.source_name.as_str(), e.field.as_str()), ("--hf-overrides", "no_such_field"));
    }

    #[test]
    fn v2_lite_derived_values() {
        let c = ModelConfig::from_json_str(LITE, "lite").unwrap();
        assert_eq!(c.q_head_dim(), 192);
        assert_eq!(c.kv_cache_dim(), 576);
        // Hand-computed: 192^-0.5 * (0.1*0.707*ln 40 + 1)^2.
        let m = 0.1 * 0.707 * 40f64.ln() + 1.0;
        assert!((c.softmax_scale() - m * m / 192f64.sqrt()).abs() < 1e-12);
        assert_eq!(c.rope_attention_factor(), 1.0);
        assert!(!c.is_moe_layer(0) && c.is_moe_layer(1));
    }

    #[test]
    fn yarn_inv_freq_matches_hand_computation() {
        let c = ModelConfig::from_json_str(LITE, "lite").unwrap();
        let f = c.rope_inv_freq();
        assert_eq!(f.len(), 32);
        // Dimension 0 is fully extrapolated (original frequency 1), the last fully interpolated.
        assert!((f[0] - 1.0).abs() < 1e-7);
        let last = 1.0 / (40.0 * 10000f64.powf(62.0 / 64.0));
        assert!((f[31] as f64 - last).abs() / last < 1e-6);
    }
}
