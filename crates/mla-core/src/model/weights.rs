//! The exact set of tensors a `ModelConfig` needs, with published HF names and shapes.
//!
//! Every backend builds its weights from a `ModelSpec`, so which tensors exist, how they are
//! named and which ones a V3 checkpoint stores in FP8 is decided here once. Shapes follow
//! PyTorch: a linear weight is `[out_features, in_features]`.

use crate::model::config::ModelConfig;

/// What a tensor is for; decides how it may be stored and how dummy weights are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    /// Token embedding table `[vocab, hidden]`.
    Embedding,
    /// A 2-D projection of attention or an MLP / expert (stored FP8 in V3 checkpoints).
    Linear,
    /// The output projection to the vocabulary (never quantized).
    LmHead,
    /// RMSNorm gain vector.
    Norm,
    /// MoE router weight `[n_routed_experts, hidden]` (never quantized).
    Router,
    /// noaux_tc expert-selection bias `[n_routed_experts]`.
    Bias,
    /// MTP's `eh_proj` `[hidden, 2 * hidden]`: a linear that the published V3 checkpoints store
    /// in bf16 even where every other linear is FP8 (vLLM and SGLang load it unquantised too).
    MtpProjection,
}

/// How tensor parallelism divides a tensor among the ranks of a group (`parallel::RankLayout`
/// turns it into one rank's `Shard`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it (norms, router, embedding, output head, q_a / kv_a).
    Replicated,
    /// Attention heads: each rank holds the rows of its heads, `per_head` rows each (q, kv_b).
    HeadRows { per_head: usize },
    /// Attention heads: each rank holds the input columns of its heads (o_proj).
    HeadCols { per_head: usize },
    /// FFN width: each rank holds an equal run of rows (gate, up) ...
    FfnRows,
    /// ... or of input columns (down).
    FfnCols,
}

/// One tensor a model needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Published checkpoint name, e.g. `model.layers.3.self_attn.kv_b_proj.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    pub role: TensorRole,
    pub split: Split,
}

impl TensorSpec {
    pub fn new(name: String, shape: Vec<usize>, role: TensorRole) -> Self {
        TensorSpec { name, shape, role, split: Split::Replicated }
    }

    fn split(mut self, split: Split) -> Self {
        self.split = split;
        self
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether block-FP8 checkpoints (DeepSeek-V3) may store this tensor as F8_E4M3 with a
    /// `weight_scale_inv` companion: the 2-D linear weights of attention and MLP / experts only.
    pub fn fp8_quantizable(&self) -> bool {
        self.role == TensorRole::Linear
    }

    /// Name of the per-block scale tensor that accompanies an FP8 weight.
    pub fn scale_inv_name(&self) -> String {
        format!("{}_scale_inv", self.name)
    }
}

/// A SiLU-gated MLP: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpSpec {
    pub gate_proj: TensorSpec,
    pub up_proj: TensorSpec,
    pub down_proj: TensorSpec,
}

/// How the query is produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuerySpec {
    /// `q_lora_rank` is null (V2-Lite): one projection.
    Direct { q_proj: TensorSpec },
    /// `q_b_proj(rmsnorm(q_a_proj(h)))` (V2, V3).
    LowRank { q_a_proj: TensorSpec, q_a_layernorm: TensorSpec, q_b_proj: TensorSpec },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionSpec {
    pub query: QuerySpec,
    /// `[kv_lora_rank + qk_rope_head_dim, hidden]`: produces `[c_kv ; k_pe]`.
    pub kv_a_proj_with_mqa: TensorSpec,
    pub kv_a_layernorm: TensorSpec,
    /// `[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`: per head `W_UK` rows then `W_UV` rows.
    pub kv_b_proj: TensorSpec,
    pub o_proj: TensorSpec,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeSpec {
    pub gate: TensorSpec,
    /// Present for noaux_tc routing only.
    pub e_score_correction_bias: Option<TensorSpec>,
    pub experts: Vec<MlpSpec>,
    /// Present when `n_shared_experts > 0`; width `moe_intermediate_size * n_shared_experts`.
    pub shared_experts: Option<MlpSpec>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FfnSpec {
    Dense(MlpSpec),
    Moe(MoeSpec),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSpec {
    pub input_layernorm: TensorSpec,
    pub self_attn: AttentionSpec,
    pub post_attention_layernorm: TensorSpec,
    pub mlp: FfnSpec,
}

/// DeepSeek-V3's multi-token-prediction module (`num_nextn_predict_layers: 1`), stored as layer
/// `num_hidden_layers` of the checkpoint. It drafts the token after next: for position `i` it
/// takes the main model's last hidden state `h_i` (after `model.norm`, the rows `lm_head` sees)
/// and the embedding of token `i + 1`, and runs
/// `eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])` through a full decoder layer with its own
/// latent cache, then `shared_head.norm` and the output projection. The embedding and head are
/// the main model's: the checkpoint's copies (`embed_tokens`, `shared_head.head`) are not read.
/// Not part of `ModelSpec`: it is loaded only when speculative decoding asks for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MtpSpec {
    pub enorm: TensorSpec,
    pub hnorm: TensorSpec,
    /// `[hidden, 2 * hidden]`: the embedding half of the input first, then the hidden half.
    pub eh_proj: TensorSpec,
    /// The decoder layer, named and shaped as main layer `num_hidden_layers` would be.
    pub layer: LayerSpec,
    pub shared_head_norm: TensorSpec,
}

impl MtpSpec {
    /// The MTP module `cfg` declares, or `None` when `num_nextn_predict_layers` is 0. Published
    /// models have at most one; more would each be their own layer, which is not supported.
    pub fn new(cfg: &ModelConfig) -> Option<Self> {
        if cfg.num_nextn_predict_layers == 0 {
            return None;
        }
        let i = cfg.num_hidden_layers;
        let h = cfg.hidden_size;
        let p = format!("model.layers.{i}");
        let norm = |n: &str| TensorSpec::new(format!("{p}.{n}.weight"), vec![h], TensorRole::Norm);
        Some(MtpSpec {
            enorm: norm("enorm"),
            hnorm: norm("hnorm"),
            eh_proj: TensorSpec::new(format!("{p}.eh_proj.weight"), vec![h, 2 * h], TensorRole::MtpProjection),
            layer: layer_spec(cfg, i),
            shared_head_norm: norm("shared_head.norm"),
        })
    }

    /// Every tensor once, in checkpoint order.
    pub fn tensors(&self) -> Vec<&TensorSpec> {
        let mut out = vec![&self.enorm, &self.hnorm, &self.eh_proj];
        out.extend(self.layer.tensors());
        out.push(&self.shared_head_norm);
        out
    }
}

/// All tensors of a model, structured the way the forward pass uses them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    pub embed_tokens: TensorSpec,
    pub layers: Vec<LayerSpec>,
    pub norm: TensorSpec,
    /// `None` when `tie_word_embeddings`: the embedding table doubles as the output projection.
    pub lm_head: Option<TensorSpec>,
}

impl ModelSpec {
    pub fn new(cfg: &ModelConfig) -> Self {
        let h = cfg.hidden_size;
        ModelSpec {
            embed_tokens: TensorSpec::new(
                "model.embed_tokens.weight".into(),
                vec![cfg.vocab_size, h],
                TensorRole::Embedding,
            ),
            layers: (0..cfg.num_hidden_layers).map(|i| layer_spec(cfg, i)).collect(),
            norm: TensorSpec::new("model.norm.weight".into(), vec![h], TensorRole::Norm),
            lm_head: (!cfg.tie_word_embeddings)
                .then(|| TensorSpec::new("lm_head.weight".into(), vec![cfg.vocab_size, h], TensorRole::LmHead)),
        }
    }

    /// The tensor used as the output projection (`lm_head`, or the embedding when tied).
    pub fn output_projection(&self) -> &TensorSpec {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Every tensor once, in checkpoint order (embedding, layers, norm, head).
    pub fn tensors(&self) -> Vec<&TensorSpec> {
        let mut out = vec![&self.embed_tokens];
        for layer in &self.layers {
            out.extend(layer.tensors());
        }
        out.push(&self.norm);
        out.extend(self.lm_head.as_ref());
        out
    }

    /// Total parameter count (the embedding counted once when tied).
    pub fn num_params(&self) -> usize {
        self.tensors().iter().map(|t| t.numel()).sum()
    }
}

impl LayerSpec {
    /// Every tensor of the layer once, in checkpoint order.
    pub fn tensors(&self) -> Vec<&TensorSpec> {
        let mut out = vec![&self.input_layernorm];
        match &self.self_attn.query {
            QuerySpec::Direct { q_proj } => out.push(q_proj),
            QuerySpec::LowRank { q_a_proj, q_a_layernorm, q_b_proj } => out.extend([q_a_proj, q_a_layernorm, q_b_proj]),
        }
        let a = &self.self_attn;
        out.extend([&a.kv_a_proj_with_mqa, &a.kv_a_layernorm, &a.kv_b_proj, &a.o_proj]);
        out.push(&self.post_attention_layernorm);
        match &self.mlp {
            FfnSpec::Dense(m) => out.extend(m.tensors()),
            FfnSpec::Moe(moe) => {
                out.push(&moe.gate);
                out.extend(moe.e_score_correction_bias.as_ref());
                for e in &moe.experts {
                    out.extend(e.tensors());
                }
                if let Some(s) = &moe.shared_experts {
                    out.extend(s.tensors());
                }
            }
        }
        out
    }
}

impl MlpSpec {
    /// Every MLP (dense, routed expert, shared experts) is split over its width under TP.
    fn new(prefix: &str, hidden: usize, inter: usize) -> Self {
        let lin =
            |n: &str, shape: Vec<usize>| TensorSpec::new(format!("{prefix}.{n}.weight"), shape, TensorRole::Linear);
        MlpSpec {
            gate_proj: lin("gate_proj", vec![inter, hidden]).split(Split::FfnRows),
            up_proj: lin("up_proj", vec![inter, hidden]).split(Split::FfnRows),
            down_proj: lin("down_proj", vec![hidden, inter]).split(Split::FfnCols),
        }
    }

    pub fn tensors(&self) -> [&TensorSpec; 3] {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
    }
}

fn layer_spec(cfg: &ModelConfig, i: usize) -> LayerSpec {
    let h = cfg.hidden_size;
    let p = format!("model.layers.{i}");
    let lin = |n: &str, shape: Vec<usize>| TensorSpec::new(format!("{p}.{n}.weight"), shape, TensorRole::Linear);
    let norm = |n: &str, d: usize| TensorSpec::new(format!("{p}.{n}.weight"), vec![d], TensorRole::Norm);
    let heads = cfg.num_attention_heads;
    // The latent projections (q_a, kv_a) serve every head: replicated; per-head weights split.
    let q_rows = Split::HeadRows { per_head: cfg.q_head_dim() };
    let query = match cfg.q_lora_rank {
        None => QuerySpec::Direct { q_proj: lin("self_attn.q_proj", vec![heads * cfg.q_head_dim(), h]).split(q_rows) },
        Some(r) => QuerySpec::LowRank {
            q_a_proj: lin("self_attn.q_a_proj", vec![r, h]),
            q_a_layernorm: norm("self_attn.q_a_layernorm", r),
            q_b_proj: lin("self_attn.q_b_proj", vec![heads * cfg.q_head_dim(), r]).split(q_rows),
        },
    };
    let self_attn = AttentionSpec {
        query,
        kv_a_proj_with_mqa: lin("self_attn.kv_a_proj_with_mqa", vec![cfg.kv_cache_dim(), h]),
        kv_a_layernorm: norm("self_attn.kv_a_layernorm", cfg.kv_lora_rank),
        kv_b_proj: lin("self_attn.kv_b_proj", vec![heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank])
            .split(Split::HeadRows { per_head: cfg.qk_nope_head_dim + cfg.v_head_dim }),
        o_proj: lin("self_attn.o_proj", vec![h, heads * cfg.v_head_dim])
            .split(Split::HeadCols { per_head: cfg.v_head_dim }),
    };
    let mlp = if cfg.is_moe_layer(i) {
        let n = cfg.n_routed_experts;
        FfnSpec::Moe(MoeSpec {
            gate: TensorSpec::new(format!("{p}.mlp.gate.weight"), vec![n, h], TensorRole::Router),
            e_score_correction_bias: (cfg.topk_method == crate::model::config::TopkMethod::NoauxTc)
                .then(|| TensorSpec::new(format!("{p}.mlp.gate.e_score_correction_bias"), vec![n], TensorRole::Bias)),
            experts: (0..n)
                .map(|e| MlpSpec::new(&format!("{p}.mlp.experts.{e}"), h, cfg.moe_intermediate_size))
                .collect(),
            shared_experts: (cfg.n_shared_experts > 0)
                .then(|| MlpSpec::new(&format!("{p}.mlp.shared_experts"), h, cfg.shared_expert_intermediate_size())),
        })
    } else {
        FfnSpec::Dense(MlpSpec::new(&format!("{p}.mlp"), h, cfg.intermediate_size))
    };
    LayerSpec {
        input_layernorm: norm("input_layernorm", h),
        self_attn,
        post_attention_layernorm: norm("post_attention_layernorm", h),
        mlp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preset(text: &str) -> ModelConfig {
        ModelConfig::from_json_str(text, "preset").unwrap()
    }

    #[test]
    fn v2_lite_has_direct_query_and_published_parameter_count() {
        let cfg = preset(include_str!("../../../../configs/deepseek-v2-lite.json"));
        let spec = ModelSpec::new(&cfg);
        assert!(matches!(spec.layers[0].self_attn.query, QuerySpec::Direct { .. }));
        assert!(matches!(spec.layers[0].mlp, FfnSpec::Dense(_)));
        assert!(matches!(spec.layers[1].mlp, FfnSpec::Moe(MoeSpec { e_score_correction_bias: None, .. })));
        // DeepSeek-V2-Lite is published as 15.7B parameters.
        let n = spec.num_params() as f64 / 1e9;
        assert!((15.6..15.8).contains(&n), "{n}");
    }

    #[test]
    fn v3_has_low_rank_query_bias_and_671b_parameters() {
        let cfg = preset(include_str!("../../../../configs/deepseek-v3.json"));
        let spec = ModelSpec::new(&cfg);
        let names: Vec<&str> = spec.tensors().iter().map(|t| t.name.as_str()).collect();
        assert!(names.contains(&"model.layers.3.mlp.gate.e_score_correction_bias"));
        assert!(names.contains(&"model.layers.60.mlp.experts.255.down_proj.weight"));
        assert!(names.contains(&"model.layers.2.mlp.down_proj.weight"));
        assert!(!names.iter().any(|n| n.starts_with("model.layers.61.")), "the MTP layer is not part of the model");
        // Published: 671B main model weights plus a 14B MTP module, which we do not load.
        let n = spec.num_params() as f64 / 1e9;
        assert!((670.5..671.5).contains(&n), "{n}");
        let fp8: Vec<&str> = spec.tensors().iter().filter(|t| t.fp8_quantizable()).map(|t| t.name.as_str()).collect();
        assert!(fp8.contains(&"model.layers.0.self_attn.q_a_proj.weight"));
        assert!(!fp8
            .iter()
            .any(|n| n.contains("norm") || n.contains("embed") || n.contains("lm_head") || n.ends_with("gate.weight")));
    }

    #[test]
    fn v3_mtp_module_is_layer_61_with_a_moe_layer_and_11_6b_parameters() {
        let cfg = preset(include_str!("../../../../configs/deepseek-v3.json"));
        let mtp = MtpSpec::new(&cfg).expect("V3 declares one MTP layer");
        let names: Vec<&str> = mtp.tensors().iter().map(|t| t.name.as_str()).collect();
        for n in [
            "model.layers.61.enorm.weight",
            "model.layers.61.hnorm.weight",
            "model.layers.61.eh_proj.weight",
            "model.layers.61.self_attn.kv_b_proj.weight",
            "model.layers.61.mlp.experts.255.down_proj.weight",
            "model.layers.61.mlp.gate.e_score_correction_bias",
            "model.layers.61.shared_head.norm.weight",
        ] {
            assert!(names.contains(&n), "{n}");
        }
        assert!(names.iter().all(|n| n.starts_with("model.layers.61.")));
        assert_eq!(mtp.eh_proj.shape, vec![7168, 14336]);
        assert!(!mtp.eh_proj.fp8_quantizable(), "published in bf16");
        // DeepSeek's report: 11.5B unique MTP parameters besides the shared embedding and head
        // (fp8-mtp.md counts 11.61B from the published tensor shapes).
        let n = mtp.tensors().iter().map(|t| t.numel()).sum::<usize>() as f64 / 1e9;
        assert!((11.5..11.7).contains(&n), "{n}");
        let v2 = preset(include_str!("../../../../configs/deepseek-v2-lite.json"));
        assert!(MtpSpec::new(&v2).is_none());
    }
}
