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
use crate::model_weights::{FfnWeights, LayerWeights, ModelWeights, MtpWeights};
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

/// The rows the MTP module drafts from.
#[derive(Debug, Clone, Copy)]
pub struct MtpInput<'a> {
    /// `[rows, hidden]`: the main model's `final_hidden_rank` rows `h_i`, or, drafting further
    /// ahead, the module's own output `hidden` of the row before.
    pub prev_hidden: &'a [f32],
    /// The tokens `t_{i+1}`, one per row.
    pub tokens: &'a [u32],
}

/// What the MTP module computes over a step's rows.
pub struct MtpOutput {
    /// Per wanted row, the draft logits for the token two positions on.
    pub logits: Vec<Option<Vec<f32>>>,
    /// `[rows, hidden]`: the module's output before `shared_head.norm`.
    pub hidden: Vec<f32>,
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
        let normed = self.final_hidden_rank(tokens, seqs, cache, peers)?;
        Ok(self.logits_of(&normed, want_logits))
    }

    /// The decoder stack over `tokens` (writing their latent rows into `cache`): per token, the
    /// last hidden state after `model.norm`, `[tokens, hidden]`. These are the rows the output
    /// projection turns into logits and the MTP module drafts from.
    pub fn final_hidden_rank(
        &self,
        tokens: &[u32],
        seqs: &[SeqSpan],
        cache: &mut LatentCache,
        mut peers: Peers,
    ) -> Result<Vec<f32>, CollectiveError> {
        self.check_counts(tokens.len(), &peers)?;
        let mut hidden = self.embed(tokens);
        for (i, layer) in self.weights.layers.iter().enumerate() {
            self.decoder_layer(i, layer, &mut hidden, seqs, cache, &mut peers)?;
        }
        let (hidden_size, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps as f32);
        Ok(hidden.par_chunks(hidden_size).flat_map_iter(|h| rms_norm(h, &self.weights.norm, eps)).collect())
    }

    /// The MTP module over rows `i` (`MtpInput`), with `seqs` at the positions `i` (its latent
    /// rows go to cache layer `num_hidden_layers`). Returns the module's output rows before `shared_head.norm`
    /// (what a further draft step takes as its `prev_hidden`) and, per wanted row, the draft
    /// logits for the token at `i + 2`.
    pub fn mtp_forward_rank(
        &self,
        mtp: &MtpWeights,
        input: MtpInput,
        seqs: &[SeqSpan],
        cache: &mut LatentCache,
        want_logits: &[bool],
        mut peers: Peers,
    ) -> Result<MtpOutput, CollectiveError> {
        let MtpInput { prev_hidden, tokens } = input;
        self.check_counts(tokens.len(), &peers)?;
        let (hidden_size, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps as f32);
        assert_eq!(prev_hidden.len(), tokens.len() * hidden_size, "one hidden row per token");
        let embedded = self.embed(tokens);
        let mut hidden: Vec<f32> = embedded
            .par_chunks(hidden_size)
            .zip(prev_hidden.par_chunks(hidden_size))
            .flat_map_iter(|(e, h)| {
                // The embedding half first, then the hidden half (as vLLM and SGLang concatenate).
                let mut both = rms_norm(e, &mtp.enorm, eps);
                both.extend(rms_norm(h, &mtp.hnorm, eps));
                let mut out = vec![0.0; hidden_size];
                mtp.eh_proj.matvec_into(&both, &mut out);
                out
            })
            .collect();
        let layer_index = self.cfg.num_hidden_layers;
        self.decoder_layer(layer_index, &mtp.layer, &mut hidden, seqs, cache, &mut peers)?;
        let normed: Vec<f32> =
            hidden.par_chunks(hidden_size).flat_map_iter(|h| rms_norm(h, &mtp.shared_head_norm, eps)).collect();
        Ok(MtpOutput { logits: self.logits_of(&normed, want_logits), hidden })
    }

    /// Under DP attention every rank's token count must be in the step's counts.
    fn check_counts(&self, tokens: usize, peers: &Peers) -> Result<(), CollectiveError> {
        if self.dp_attention() && (peers.counts.len() != self.layout.world || peers.counts[self.layout.rank] != tokens)
        {
            return Err(CollectiveError(format!(
                "rank {} feeds {} tokens but the step's counts are {:?}",
                self.layout.rank, tokens, peers.counts
            )));
        }
        Ok(())
    }

    fn dp_attention(&self) -> bool {
        self.layout.dp_attention && self.layout.world > 1
    }

    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        tokens.iter().flat_map(|&t| self.weights.embed_tokens.row(t as usize).iter().copied()).collect()
    }

    /// `hidden += MLA(norm(hidden))` then `hidden += FFN(norm(hidden))` for layer `index` (its
    /// cache layer and collective tags).
    fn decoder_layer(
        &self,
        index: usize,
        layer: &LayerWeights,
        hidden: &mut [f32],
        seqs: &[SeqSpan],
        cache: &mut LatentCache,
        peers: &mut Peers,
    ) -> Result<(), CollectiveError> {
        let (hidden_size, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps as f32);
        let ctx = MlaContext {
            dims: self.dims,
            rope: &self.rope,
            softmax_scale: self.softmax_scale,
            block_size: cache.block_size(),
        };
        let comm = &mut *peers.comm;
        let x = rms_norm_rows(hidden, &layer.input_layernorm, eps);
        let mut attn = mla_forward(&layer.self_attn, &ctx, index, &x, seqs, cache);
        if !self.dp_attention() {
            // This rank's heads' share of o_proj; identity on one rank.
            comm.all_reduce_sum(Tag::new("attention all_reduce", index), &mut attn)?;
        }
        add_in_place(hidden, &attn);
        let x = rms_norm_rows(hidden, &layer.post_attention_layernorm, eps);
        let ffn = if self.dp_attention() {
            let row_counts: Vec<usize> = peers.counts.iter().map(|c| c * hidden_size).collect();
            let all = comm.all_gather(Tag::new("ffn all_gather", index), &x, &row_counts)?;
            let partial = self.ffn(&layer.mlp, &all);
            comm.reduce_scatter(Tag::new("ffn reduce_scatter", index), &partial, &row_counts)?
        } else {
            let mut partial = self.ffn(&layer.mlp, &x);
            comm.all_reduce_sum(Tag::new("ffn all_reduce", index), &mut partial)?;
            partial
        };
        add_in_place(hidden, &ffn);
        Ok(())
    }

    /// The output projection of the wanted rows of `normed` (rows already through their norm).
    pub fn logits_of(&self, normed: &[f32], want: &[bool]) -> Vec<Option<Vec<f32>>> {
        let head = self.weights.output_projection();
        normed
            .par_chunks(self.cfg.hidden_size)
            .zip(want.par_iter())
            .map(|(h, &want)| {
                want.then(|| {
                    let mut logits = vec![0.0; head.rows];
                    head.matvec_into(h, &mut logits);
                    logits
                })
            })
            .collect()
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
