//! One rank of the CPU reference backend: its part of the model, its latent cache, and how it
//! runs its `StepPlan` (the normal path for prefill, the absorbed path for decode).

use crate::kv_cache::LatentCache;
use crate::mla::{AttentionPath, SeqSpan};
use crate::model::{CpuModel, Peers};
use crate::model_weights::MtpWeights;
use crate::speculative;
use mla_core::sampling::score_rows;
use mla_core::step::plan::{LogitsRequest, SampledToken, SeqResult, StepOutput, StepPlan};
use mla_core::{CacheLayout, KvCacheDtype, ModelConfig, MtpSpec, RankLayout, WeightSource};
use std::collections::HashMap;

pub struct CpuRank {
    model: CpuModel,
    cache: LatentCache,
    layout: CacheLayout,
    /// The MTP layer, when speculative decoding is on (its rows are the cache's last layer).
    mtp: Option<MtpWeights>,
    /// The sampled drafts of the last step's sequences and what they were drawn from, until the
    /// next step verifies them (a sequence absent from a step loses them: its drafts are then
    /// verified against their point masses, exact but accepted less often).
    drawn: HashMap<u64, crate::verdict::Drawn>,
}

impl CpuRank {
    /// Rank `rank`'s part of `cfg`'s weights from `weights` and a zeroed latent cache of
    /// `num_blocks` blocks of `block_size` tokens per layer, holding `kv_dtype`.
    pub fn new(
        cfg: ModelConfig,
        weights: &dyn WeightSource,
        rank: RankLayout,
        block_size: usize,
        num_blocks: usize,
        kv_dtype: KvCacheDtype,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(block_size > 0, "block_size must be positive");
        anyhow::ensure!(num_blocks > 0, "num_blocks must be positive");
        let cache = LatentCache::new(cfg.num_hidden_layers, block_size, num_blocks, cfg.kv_cache_dim(), kv_dtype);
        let model = CpuModel::new_rank(cfg, weights, rank)?;
        Ok(CpuRank { model, cache, layout: CacheLayout { block_size, num_blocks }, mtp: None, drawn: HashMap::new() })
    }

    /// Loads the model's MTP layer for speculative decoding and gives it a cache layer of its
    /// own after the main ones (the cache is new and empty: this is part of construction).
    pub fn enable_mtp(&mut self, weights: &dyn WeightSource, rank: RankLayout) -> anyhow::Result<()> {
        let cfg = self.model.config();
        let spec = MtpSpec::new(cfg).ok_or_else(|| {
            anyhow::anyhow!("the model has no multi-token-prediction layer (num_nextn_predict_layers is 0)")
        })?;
        self.mtp = Some(MtpWeights::load_rank(&spec, weights, rank)?);
        let CacheLayout { block_size, num_blocks } = self.layout;
        let (dim, dtype) = (self.cache.dim(), self.cache.dtype());
        // Free the old cache before the larger one is allocated, so start-up never holds both.
        self.cache = LatentCache::new(0, block_size, num_blocks, dim, dtype);
        self.cache = LatentCache::new(cfg.num_hidden_layers + 1, block_size, num_blocks, dim, dtype);
        Ok(())
    }

    pub fn model(&self) -> &CpuModel {
        &self.model
    }

    pub fn cache(&self) -> &LatentCache {
        &self.cache
    }

    pub fn cache_mut(&mut self) -> &mut LatentCache {
        &mut self.cache
    }

    pub fn cache_layout(&self) -> CacheLayout {
        self.layout
    }

    /// Checks `plan` against this rank's cache and the model.
    pub fn validate(&self, plan: &StepPlan) -> anyhow::Result<()> {
        let cfg = self.model.config();
        plan.validate(self.layout.block_size, self.layout.num_blocks, cfg.vocab_size, cfg.max_position_embeddings)?;
        Ok(())
    }

    /// Runs `plan` (validated) with this rank's peers; an empty plan still makes every collective.
    /// `mtp_passes`: every rank's rows in each MTP pass of the step
    /// (`mla_core::speculative::mtp_pass_counts` of the step's plans; empty without speculative
    /// decoding). Under DP attention a rank runs them all, with its own rows or none.
    pub fn run(&mut self, plan: &StepPlan, peers: Peers, mtp_passes: &[Vec<usize>]) -> anyhow::Result<StepOutput> {
        let Peers { comm, counts } = peers;
        // Copies before any write, so a fork reads its block as the steps before left it.
        for f in plan.seqs.iter().filter_map(|s| s.fork) {
            self.cache.copy_block(f.from as usize, f.to as usize);
        }
        let first_decode = plan.num_prefill();
        let mut tokens = Vec::with_capacity(plan.num_tokens());
        let mut spans = Vec::with_capacity(plan.seqs.len());
        let mut want = Vec::with_capacity(plan.num_tokens());
        for (i, s) in plan.seqs.iter().enumerate() {
            spans.push(SeqSpan {
                path: if i < first_decode { AttentionPath::Normal } else { AttentionPath::Absorbed },
                start: tokens.len(),
                len: s.tokens.len(),
                context_len: s.context_len,
                block_table: &s.block_table,
            });
            tokens.extend_from_slice(&s.tokens);
            // The sampled row, and with drafts fed every row from the last emitted token on.
            let last_needed = s.logits == LogitsRequest::Last || s.sample.is_some();
            let first_sampled = s.tokens.len() - 1 - s.drafts_fed();
            want.extend((0..s.tokens.len()).map(|j| {
                matches!(s.logits, LogitsRequest::All | LogitsRequest::Scored { .. })
                    || (last_needed && j + 1 == s.tokens.len())
                    || (s.sample.is_some() && j >= first_sampled)
            }));
        }
        let speculative = !mtp_passes.is_empty() || plan.has_speculative();
        anyhow::ensure!(
            !speculative || self.mtp.is_some(),
            "the step asks for speculative decoding but the MTP layer is not loaded"
        );
        let (mut logits, hidden) = if speculative {
            let hidden =
                self.model.final_hidden_rank(&tokens, &spans, &mut self.cache, Peers { comm: &mut *comm, counts })?;
            (self.model.logits_of(&hidden, &want), hidden)
        } else {
            (
                self.model.forward_rank(&tokens, &spans, &mut self.cache, &want, Peers { comm: &mut *comm, counts })?,
                Vec::new(),
            )
        };

        let mut verified = Vec::with_capacity(plan.seqs.len());
        for (s, span) in plan.seqs.iter().zip(&spans) {
            let rows = &logits[span.start..span.start + span.len];
            let v = crate::verdict::verify(s, rows, self.drawn.get(&s.seq_id));
            verified.push(v.map_err(|e| anyhow::anyhow!("sequence {}: {e}", s.seq_id))?);
        }
        let proposals = match (&self.mtp, speculative) {
            (Some(mtp), true) => {
                let cache = &mut self.cache;
                speculative::draft(&self.model, mtp, plan, &hidden, &verified, cache, comm, mtp_passes)?
            }
            _ => crate::verdict::Proposals::new(plan.seqs.len()),
        };
        let (mut drafts, kept) = proposals.keep(plan);
        self.drawn = kept;
        let mut emitted: Vec<Vec<SampledToken>> =
            verified.into_iter().map(mla_core::speculative::Verified::into_emitted).collect();
        let mut out = StepOutput::default();
        for (i, (s, span)) in plan.seqs.iter().zip(&spans).enumerate() {
            let rows = &mut logits[span.start..span.start + span.len];
            let mut all = || rows.iter_mut().map(|r| r.take().expect("all logits")).collect::<Vec<_>>();
            let (logits, scores) = match s.logits {
                LogitsRequest::None => (vec![], vec![]),
                LogitsRequest::Last => {
                    (vec![rows.last_mut().and_then(|r| r.take()).expect("last-token logits")], vec![])
                }
                LogitsRequest::All => (all(), vec![]),
                LogitsRequest::Scored { top, after } => (vec![], score_rows(&all(), &s.tokens, top, after)),
            };
            let mut tokens = std::mem::take(&mut emitted[i]).into_iter();
            let sampled = tokens.next();
            out.seqs.push(SeqResult {
                seq_id: s.seq_id,
                logits,
                sampled,
                extra_tokens: tokens.collect(),
                drafts: std::mem::take(&mut drafts[i]),
                scores,
            });
        }
        Ok(out)
    }
}
