//! The decoder stack: embedding, per layer `h += MLA(norm(h))` then `h += FFN(norm(h))` (dense
//! SiLU MLP or DeepSeekMoE), final norm, output projection.

use crate::kv_cache::LatentCache;
use crate::mla::{mla_forward, AttentionPath, MlaContext, SeqSpan};
use crate::mla_dims::MlaDims;
use crate::model_weights::{FfnWeights, ModelWeights};
use crate::norm::{rms_norm, rms_norm_rows};
use crate::rope::Rope;
use mla_core::{CheckpointError, ModelConfig, WeightSource};
use rayon::prelude::*;

pub struct CpuModel {
    cfg: ModelConfig,
    weights: ModelWeights,
    rope: Rope,
    dims: MlaDims,
    softmax_scale: f32,
}

impl CpuModel {
    pub fn new(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self, CheckpointError> {
        let weights = ModelWeights::load(&cfg, src)?;
        Ok(CpuModel {
            rope: Rope::new(&cfg),
            dims: MlaDims::from_config(&cfg),
            softmax_scale: cfg.softmax_scale() as f32,
            weights,
            cfg,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn weights(&self) -> &ModelWeights {
        &self.weights
    }

    pub fn dims(&self) -> MlaDims {
        self.dims
    }

    /// Runs the flattened `tokens` of `seqs` through the model, writing their latent rows into
    /// `cache`. Returns, per token, its logits when `want_logits[token]` is set.
    pub fn forward(
        &self,
        tokens: &[u32],
        seqs: &[SeqSpan],
        cache: &mut LatentCache,
        path: AttentionPath,
        want_logits: &[bool],
    ) -> Vec<Option<Vec<f32>>> {
        let cfg = &self.cfg;
        let (hidden_size, eps) = (cfg.hidden_size, cfg.rms_norm_eps as f32);
        let mut hidden: Vec<f32> =
            tokens.iter().flat_map(|&t| self.weights.embed_tokens.row(t as usize).iter().copied()).collect();
        let ctx = MlaContext {
            dims: self.dims,
            rope: &self.rope,
            softmax_scale: self.softmax_scale,
            block_size: cache.block_size(),
        };
        for (i, layer) in self.weights.layers.iter().enumerate() {
            let x = rms_norm_rows(&hidden, &layer.input_layernorm, eps);
            let attn = mla_forward(&layer.self_attn, &ctx, i, &x, seqs, cache, path);
            add_in_place(&mut hidden, &attn);
            let x = rms_norm_rows(&hidden, &layer.post_attention_layernorm, eps);
            let ffn = match &layer.mlp {
                FfnWeights::Dense(mlp) => mlp.forward(&x),
                FfnWeights::Moe(moe) => moe.forward(cfg, &x),
            };
            add_in_place(&mut hidden, &ffn);
        }
        let head = self.weights.output_projection();
        hidden
            .par_chunks(hidden_size)
            .zip(want_logits.par_iter())
            .map(|(h, &want)| {
                want.then(|| {
                    let normed = rms_norm(h, &self.weights.norm, eps);
                    let mut logits = vec![0.0; head.rows];
                    head.matvec_into(&normed, &mut logits);
                    logits
                })
            })
            .collect()
    }
}

fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}
