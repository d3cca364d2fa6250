//! The decoder stack: embedding, per layer `h += MLA(norm(h))` then `h += FFN(norm(h))` (dense
//! SiLU MLP or DeepSeekMoE), final norm, output projection.
//!
//! A model may be one rank of several (`RankLayout`). Under tensor parallelism it holds its share
//! of the heads and of every FFN width, and the partial attention and FFN outputs are summed over
//! the ranks (`Collective::all_reduce_sum`). Under DP attention it holds the whole attention and
//! only its own requests' tokens; each FFN runs, with this rank's share of the width, over the
//! normed rows of every rank (`all_gather`), and `reduce_scatter` hands each rank the sums for
//! its own rows. The CPU backend runs this on threads as the reference for the multi-GPU
//! backends.

use crate::kv_cache::LatentCache;
use crate::mla::{mla_forward, MlaContext, SeqSpan};
use crate::mla_dims::MlaDims;
use crate::model_weights::{FfnWeights, ModelWeights};
use crate::norm::{rms_norm, rms_norm_rows};
use crate::rope::Rope;
use mla_core::runtime::collective::{Collective, CollectiveError, Solo, Tag};
use mla_core::{CheckpointError, ModelConfig, RankLayout, WeightSource};
use rayon::prelude::*;

pub struct CpuModel {
    /// The model's config (vocabulary, norms, routing); `local` has this rank's widths.
    cfg: ModelConfig,
    local: ModelConfig,
    layout: RankLayout,
    weights: ModelWeights,
    rope: Rope,
    dims: MlaDims,
    softmax_scale: f32,
}

/// A rank's link to the other ranks of its group for one step.
pub struct Peers<'a> {
    pub comm: &'a mut dyn Collective,
    /// Every rank's token count in this step, under DP attention (rank r feeds `counts[r]`
    /// tokens); under tensor parallelism every rank feeds the same tokens and it is unused.
    pub counts: &'a [usize],
}

impl CpuModel {
    pub fn new(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self, CheckpointError> {
        Self::new_rank(cfg, src, RankLayout::SINGLE)
    }

    /// Rank `layout`'s part of the model (`RankLayout::shard` of every tensor).
    pub fn new_rank(cfg: ModelConfig, src: &dyn WeightSource, layout: RankLayout) -> Result<Self, CheckpointError> {
        let weights = ModelWeights::load_rank(&cfg, src, layout)?;
        let local = layout.local_config(&cfg);
        Ok(CpuModel {
            rope: Rope::new(&cfg),
            dims: MlaDims::from_config(&local),
            softmax_scale: cfg.softmax_scale() as f32,
            weights,
            local,
            layout,
            cfg,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn layout(&self) -> RankLayout {
        self.layout
    }

    pub fn weights(&self) -> &ModelWeights {
        &self.weights
    }

    pub fn dims(&self) -> MlaDims {
        self.dims
    }

    /// Runs the flattened `tokens` of `seqs` through a single-rank model, writing their latent
    /// rows into `cache`. Returns, per token, its logits when `want_logits[token]` is set.
    pub fn forward(
        &self,
        tokens: &[u32],
        seqs: &[SeqSpan],
        cache: &mut LatentCache,
        want_logits: &[bool],
    ) -> Vec<Option<Vec<f32>>> {
        assert_eq!(self.layout.world, 1, "a rank of several runs through forward_rank");
        let peers = Peers { comm: &mut Solo, counts: &[tokens.len()] };
        self.forward_rank(tokens, seqs, cache, want_logits, peers).expect("a single rank's collectives cannot fail")
    }

    /// `forward` for one rank of a group: the same calls on every rank, in the same order, even
    /// with no tokens (an idle DP-attention rank), so no rank waits for one that skipped a call.
    pub fn forward_rank(
        &self,
        tokens: &[u32],
        seqs: &[SeqSpan],
        cache: &mut LatentCache,
        want_logits: &[bool],
        peers: Peers,
    ) -> Result<Vec<Option<Vec<f32>>>, CollectiveError> {
        let cfg = &self.cfg;
        let comm = peers.comm;
        let (hidden_size, eps) = (cfg.hidden_size, cfg.rms_norm_eps as f32);
        let dp_attention = self.layout.dp_attention && self.layout.world > 1;
        if dp_attention && (peers.counts.len() != self.layout.world || peers.counts[self.layout.rank] != tokens.len()) {
            return Err(CollectiveError(format!(
                "rank {} feeds {} tokens but the step's counts are {:?}",
                self.layout.rank,
                tokens.len(),
                peers.counts
            )));
        }
        let row_counts: Vec<usize> = peers.counts.iter().map(|c| c * hidden_size).collect();
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
            let mut attn = mla_forward(&layer.self_attn, &ctx, i, &x, seqs, cache);
            if !dp_attention {
                // This rank's heads' share of o_proj; identity on one rank.
                comm.all_reduce_sum(Tag::new("attention all_reduce", i), &mut attn)?;
            }
            add_in_place(&mut hidden, &attn);
            let x = rms_norm_rows(&hidden, &layer.post_attention_layernorm, eps);
            let ffn = if dp_attention {
                let all = comm.all_gather(Tag::new("ffn all_gather", i), &x, &row_counts)?;
                let partial = self.ffn(&layer.mlp, &all);
                comm.reduce_scatter(Tag::new("ffn reduce_scatter", i), &partial, &row_counts)?
            } else {
                let mut partial = self.ffn(&layer.mlp, &x);
                comm.all_reduce_sum(Tag::new("ffn all_reduce", i), &mut partial)?;
                partial
            };
            add_in_place(&mut hidden, &ffn);
        }
        let head = self.weights.output_projection();
        Ok(hidden
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
            .collect())
    }

    /// This rank's share of the FFN over rows `x` (the whole FFN on one rank).
    fn ffn(&self, ffn: &FfnWeights, x: &[f32]) -> Vec<f32> {
        match ffn {
            FfnWeights::Dense(mlp) => mlp.forward(x),
            FfnWeights::Moe(moe) => moe.forward(&self.local, x),
        }
    }
}

fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}
