//! `CpuBackend`: the model plus its paged latent cache behind mla-core's `Backend` trait.

use crate::kv_cache::LatentCache;
use crate::mla::{AttentionPath, SeqSpan};
use crate::model::CpuModel;
use mla_core::plan::{LogitsRequest, SeqResult, StepKind, StepOutput, StepPlan};
use mla_core::sampling::sample;
use mla_core::{Backend, CacheLayout, ModelConfig, WeightSource};

pub struct CpuBackend {
    model: CpuModel,
    cache: LatentCache,
    layout: CacheLayout,
}

impl CpuBackend {
    /// Loads `cfg`'s weights from `weights` (a checkpoint or dummy weights) and allocates a
    /// zeroed latent cache of `num_blocks` blocks of `block_size` tokens per layer.
    pub fn new(
        cfg: ModelConfig,
        weights: &dyn WeightSource,
        block_size: usize,
        num_blocks: usize,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(block_size > 0, "block_size must be positive");
        anyhow::ensure!(num_blocks > 0, "num_blocks must be positive");
        tracing::info!(source = %weights.describe(), block_size, num_blocks, "loading cpu backend");
        let cache = LatentCache::new(cfg.num_hidden_layers, block_size, num_blocks, cfg.kv_cache_dim());
        let model = CpuModel::new(cfg, weights)?;
        Ok(CpuBackend { model, cache, layout: CacheLayout { block_size, num_blocks } })
    }

    pub fn model(&self) -> &CpuModel {
        &self.model
    }

    /// Read access to the latent cache (tests and cross-backend checks).
    pub fn cache(&self) -> &LatentCache {
        &self.cache
    }
}

impl Backend for CpuBackend {
    fn device_name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn model_config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn cache_layout(&self) -> CacheLayout {
        self.layout
    }

    fn step(&mut self, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        let cfg = self.model.config();
        plan.validate(self.layout.block_size, self.layout.num_blocks, cfg.vocab_size, cfg.max_position_embeddings)?;
        let path = match plan.kind {
            StepKind::Prefill => AttentionPath::Normal,
            StepKind::Decode => AttentionPath::Absorbed,
        };
        let mut tokens = Vec::with_capacity(plan.num_tokens());
        let mut spans = Vec::with_capacity(plan.seqs.len());
        let mut want = Vec::with_capacity(plan.num_tokens());
        for s in &plan.seqs {
            spans.push(SeqSpan {
                start: tokens.len(),
                len: s.tokens.len(),
                context_len: s.context_len,
                block_table: &s.block_table,
            });
            tokens.extend_from_slice(&s.tokens);
            let last_needed = s.logits == LogitsRequest::Last || s.sample.is_some();
            want.extend(
                (0..s.tokens.len()).map(|j| s.logits == LogitsRequest::All || (last_needed && j + 1 == s.tokens.len())),
            );
        }
        let mut logits = self.model.forward(&tokens, &spans, &mut self.cache, path, &want);

        let mut out = StepOutput::default();
        for (s, span) in plan.seqs.iter().zip(&spans) {
            let rows = &mut logits[span.start..span.start + span.len];
            let sampled = s
                .sample
                .as_ref()
                .map(|req| sample(rows.last().and_then(|r| r.as_ref()).expect("last-token logits were computed"), req));
            let logits = match s.logits {
                LogitsRequest::None => vec![],
                LogitsRequest::Last => vec![rows.last_mut().and_then(|r| r.take()).expect("last-token logits")],
                LogitsRequest::All => rows.iter_mut().map(|r| r.take().expect("all logits")).collect(),
            };
            out.seqs.push(SeqResult { seq_id: s.seq_id, logits, sampled });
        }
        Ok(out)
    }
}
