//! The model's tensors in f32, built from any `WeightSource` through mla-core's `ModelSpec`
//! (so names, shapes and FP8 handling are the shared ones).

use crate::linear::Matrix;
use crate::mlp::SiluMlp;
use crate::moe::MoeBlock;
use mla_core::model::weight_source::LoadProgress;
use mla_core::model::weights::{AttentionSpec, FfnSpec, LayerSpec, MlpSpec, QuerySpec};
use mla_core::{CheckpointError, ModelConfig, ModelSpec, MtpSpec, RankLayout, TensorSpec, WeightSource};

#[derive(Debug, Clone)]
pub enum QueryWeights {
    Direct { q_proj: Matrix },
    LowRank { q_a_proj: Matrix, q_a_layernorm: Vec<f32>, q_b_proj: Matrix },
}

#[derive(Debug, Clone)]
pub struct MlaWeights {
    pub query: QueryWeights,
    pub kv_a_proj_with_mqa: Matrix,
    pub kv_a_layernorm: Vec<f32>,
    pub kv_b_proj: Matrix,
    pub o_proj: Matrix,
}

#[derive(Debug, Clone)]
pub enum FfnWeights {
    Dense(SiluMlp),
    Moe(MoeBlock),
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub input_layernorm: Vec<f32>,
    pub self_attn: MlaWeights,
    pub post_attention_layernorm: Vec<f32>,
    pub mlp: FfnWeights,
}

#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub embed_tokens: Matrix,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `None` when the embedding is tied to the output projection.
    pub lm_head: Option<Matrix>,
}

impl ModelWeights {
    pub fn load(cfg: &ModelConfig, src: &dyn WeightSource) -> Result<Self, CheckpointError> {
        Self::load_rank(cfg, src, RankLayout::SINGLE)
    }

    /// The part of `cfg`'s weights that rank `layout` holds (`RankLayout::shard` of each tensor).
    pub fn load_rank(cfg: &ModelConfig, src: &dyn WeightSource, layout: RankLayout) -> Result<Self, CheckpointError> {
        let spec = ModelSpec::new(cfg);
        let what = if layout.world == 1 {
            "loading weights (cpu)".to_string()
        } else {
            format!("loading weights (cpu, rank {} of {})", layout.rank, layout.world)
        };
        let loader = Loader { src, layout, bar: LoadProgress::new(spec.tensors().len(), &what) };
        let weights = ModelWeights {
            embed_tokens: loader.matrix(&spec.embed_tokens)?,
            layers: spec.layers.iter().map(|l| loader.layer(l)).collect::<Result<_, CheckpointError>>()?,
            norm: loader.vector(&spec.norm)?,
            lm_head: spec.lm_head.as_ref().map(|h| loader.matrix(h)).transpose()?,
        };
        loader.bar.finish();
        Ok(weights)
    }

    /// The output projection `[vocab, hidden]`.
    pub fn output_projection(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }
}

/// The multi-token-prediction module (`mla_core::MtpSpec`): the draft model of speculative
/// decoding. Its embedding and output projection are the main model's.
#[derive(Debug, Clone)]
pub struct MtpWeights {
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// `[hidden, 2 * hidden]`, replicated on every rank (it is small next to the layer).
    pub eh_proj: Matrix,
    pub layer: LayerWeights,
    pub shared_head_norm: Vec<f32>,
}

impl MtpWeights {
    /// Rank `layout`'s part of the MTP module `spec` (`MtpSpec::new` of the model's config).
    pub fn load_rank(spec: &MtpSpec, src: &dyn WeightSource, layout: RankLayout) -> Result<Self, CheckpointError> {
        let what = format!("loading the MTP layer (cpu, rank {} of {})", layout.rank, layout.world);
        let loader = Loader { src, layout, bar: LoadProgress::new(spec.tensors().len(), &what) };
        let weights = MtpWeights {
            enorm: loader.vector(&spec.enorm)?,
            hnorm: loader.vector(&spec.hnorm)?,
            eh_proj: loader.matrix(&spec.eh_proj)?,
            layer: loader.layer(&spec.layer)?,
            shared_head_norm: loader.vector(&spec.shared_head_norm)?,
        };
        loader.bar.finish();
        Ok(weights)
    }
}

struct Loader<'a> {
    src: &'a dyn WeightSource,
    layout: RankLayout,
    bar: LoadProgress,
}

impl Loader<'_> {
    /// This rank's part of the tensor.
    fn vector(&self, spec: &TensorSpec) -> Result<Vec<f32>, CheckpointError> {
        let v = self.src.read_f32_shard(spec, &self.layout.shard(spec))?;
        self.bar.inc();
        Ok(v)
    }

    fn matrix(&self, spec: &TensorSpec) -> Result<Matrix, CheckpointError> {
        let shape = self.layout.shard(spec).shape(&spec.shape);
        let v = self.vector(spec)?;
        Ok(Matrix::new(shape[0], shape[1], v))
    }

    fn layer(&self, l: &LayerSpec) -> Result<LayerWeights, CheckpointError> {
        Ok(LayerWeights {
            input_layernorm: self.vector(&l.input_layernorm)?,
            self_attn: self.attention(&l.self_attn)?,
            post_attention_layernorm: self.vector(&l.post_attention_layernorm)?,
            mlp: match &l.mlp {
                FfnSpec::Dense(m) => FfnWeights::Dense(self.mlp(m)?),
                FfnSpec::Moe(moe) => FfnWeights::Moe(MoeBlock {
                    gate: self.matrix(&moe.gate)?,
                    correction_bias: moe.e_score_correction_bias.as_ref().map(|b| self.vector(b)).transpose()?,
                    experts: moe.experts.iter().map(|e| self.mlp(e)).collect::<Result<_, _>>()?,
                    shared_experts: moe.shared_experts.as_ref().map(|s| self.mlp(s)).transpose()?,
                }),
            },
        })
    }

    fn mlp(&self, m: &MlpSpec) -> Result<SiluMlp, CheckpointError> {
        Ok(SiluMlp {
            gate_proj: self.matrix(&m.gate_proj)?,
            up_proj: self.matrix(&m.up_proj)?,
            down_proj: self.matrix(&m.down_proj)?,
        })
    }

    fn attention(&self, a: &AttentionSpec) -> Result<MlaWeights, CheckpointError> {
        Ok(MlaWeights {
            query: match &a.query {
                QuerySpec::Direct { q_proj } => QueryWeights::Direct { q_proj: self.matrix(q_proj)? },
                QuerySpec::LowRank { q_a_proj, q_a_layernorm, q_b_proj } => QueryWeights::LowRank {
                    q_a_proj: self.matrix(q_a_proj)?,
                    q_a_layernorm: self.vector(q_a_layernorm)?,
                    q_b_proj: self.matrix(q_b_proj)?,
                },
            },
            kv_a_proj_with_mqa: self.matrix(&a.kv_a_proj_with_mqa)?,
            kv_a_layernorm: self.vector(&a.kv_a_layernorm)?,
            kv_b_proj: self.matrix(&a.kv_b_proj)?,
            o_proj: self.matrix(&a.o_proj)?,
        })
    }
}
