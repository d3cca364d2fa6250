//! One forward step: embedding, the decoder layers (MLA attention on the normal path for prompt
//! chunks and the absorbed path for decode rows, both in a mixed step; dense MLP or DeepSeekMoE
//! over every row), the final norm, the output projection for the rows that need logits, and
//! device sampling.
//!
//! `queue_forward` only queues work on the stream: no allocation, no synchronisation, no host
//! reads of device data, so a decode step can be captured as a CUDA graph as is.

use super::memory_plan::{self, Activations, MemoryPlan, PlanInputs};
use super::meta::{MetaLimits, StepMeta};
use super::meta_buffers::MetaBuffers;
use super::options::ModelOptions;
use super::parallel::{FfnRows, RankLink, RankMode};
use super::small_linear::SmallLinear;
use super::weights::DeviceWeights;
use super::workspace::Workspace;
use crate::device::Device;
use crate::gpu::{DSlice, DeviceBuffer, PinnedBuffer};
use crate::ops::{
    cache_row_bytes, AddRmsNorm, Embedding, LatentCacheSlice, NormDelta, RmsNormF32, RouteParams, Sample,
    SamplerOutputs, ScoreOutputs, Scores, Strided, Verdicts, MAX_SPEC_DRAFTS, MAX_TOP_LOGPROBS, PAGE_SIZE,
    SCORE_ROW_WORDS,
};
use half::bf16;
use mla_core::step::plan::{LogitsRequest, RowScore, SampledToken, SeqResult, StepOutput, StepPlan};
use mla_core::{KvCacheDtype, ModelConfig, StepLimits};

pub struct CudaModel {
    pub cfg: ModelConfig,
    pub weights: DeviceWeights,
    pub ws: Workspace,
    /// [layers][(num_blocks + 1) * PAGE_SIZE] rows of [kv_lora_rank + qk_rope] in bf16, or the
    /// FP8 rows of `mla_core::model::latent_fp8`, as bytes.
    pub cache: DeviceBuffer<u8>,
    pub cache_dtype: KvCacheDtype,
    /// Blocks the block manager may use; block `num_blocks` (`pad_block`) is private: the rows
    /// that pad a decode batch up to a captured graph's size write and read only it.
    pub num_blocks: usize,
    pub(super) inv_freq: DeviceBuffer<f32>,
    pub(super) meta: MetaBuffers,
    host_tokens: PinnedBuffer<i32>,
    host_logprobs: PinnedBuffer<f32>,
    host_top_ids: PinnedBuffer<i32>,
    host_top_lps: PinnedBuffer<f32>,
    pub lim: MetaLimits,
    pub max_model_len: usize,
    pub(super) scale: f32,
    pub(super) attn_factor: f32,
    pub(super) eps: f32,
    pub(super) route: RouteParams,
    /// Bytes measured for the activation workspace (cuMemGetInfo before/after allocating it).
    pub activation_bytes: usize,
    /// Forces the decode split count (tests comparing eager steps with a captured graph).
    pub decode_splits_override: Option<usize>,
    /// Benchmarks only (`mla-bench spec-step`): each fed draft stands with this probability,
    /// whatever the target chose, so that a model of dummy weights emits the tokens of a given
    /// acceptance rate. The output is then not the model's: never set by the server.
    pub forced_acceptance: Option<(f64, mla_core::SplitMix64)>,
    /// The verdict launch the next sampler runs first, as (distribution rows, sequences) of
    /// `ws.mtp.drafts`: set by a speculative step around its verify step alone (`speculative`).
    pub(super) pending_verdict: Option<(usize, usize)>,
    /// Which kernel runs the dense projections of small steps.
    pub linears: SmallLinear,
    pub mode: RankMode,
    /// The largest step this rank was sized for (after the memory planner).
    pub step_limits: StepLimits,
}

/// A step's result, after leaving no copy or kernel of it in flight when it failed.
pub(super) fn settled<T>(dev: &Device, r: anyhow::Result<T>) -> anyhow::Result<T> {
    if r.is_err() {
        let _ = dev.gpu.sync();
    }
    r
}

/// Activations as `Strided` rows of `width` (packed).
pub(super) fn rows<T>(buf: &DeviceBuffer<T>, width: usize) -> Strided<'_, T> {
    Strided::new(buf.slice(), width)
}

impl CudaModel {
    pub fn new(dev: &Device, cfg: ModelConfig, weights: DeviceWeights, opts: &ModelOptions) -> anyhow::Result<Self> {
        Self::new_rank(dev, cfg, weights, opts, RankLink::Single)
    }

    /// A rank of a group: `cfg` is the rank's own share and `link` the collective it meets the
    /// others through. Every rank of the group (on every node) takes the smallest KV cache any of
    /// them has room for, so all ranks of a step see the same cache (`memory_plan`).
    pub fn new_rank(
        dev: &Device,
        cfg: ModelConfig,
        weights: DeviceWeights,
        opts: &ModelOptions,
        link: RankLink,
    ) -> anyhow::Result<Self> {
        super::check_supported(&cfg)?;
        dev.gpu.sync()?;
        let max_model_len = opts.max_model_len.min(cfg.max_position_embeddings).max(1);
        let gathered = link.gathered_ranks();
        anyhow::ensure!(
            opts.step_limits.gathered_ranks == gathered,
            "step limits gather {} ranks' rows, but this rank's FFN gathers {gathered}",
            opts.step_limits.gathered_ranks
        );
        anyhow::ensure!(
            weights.mtp.is_some() == (opts.mtp_drafts > 0),
            "speculative decoding asks for {} drafts per step, but the MTP module is {}loaded",
            opts.mtp_drafts,
            if weights.mtp.is_some() { "" } else { "not " }
        );
        anyhow::ensure!(
            opts.mtp_drafts <= MAX_SPEC_DRAFTS,
            "{} drafts per step; the CUDA verdict takes at most {MAX_SPEC_DRAFTS}",
            opts.mtp_drafts
        );
        let fp8 = weights.fp8_share();
        let inputs = PlanInputs {
            cfg: &cfg,
            fp8: &fp8,
            step_limits: opts.step_limits,
            fit: opts.fit,
            kv_goal_tokens: opts.kv_goal_tokens,
            max_kv_chunk: opts.max_kv_chunk,
            max_model_len,
            gpu_memory_utilization: opts.gpu_memory_utilization,
            num_blocks: opts.num_blocks,
            small_batch_gemv: opts.small_batch_gemv,
            w8a8: opts.fp8_w8a8 && dev.gpu.info.compute_capability == (9, 0),
            link,
            weight_bytes: weights.bytes(),
            cache_row_bytes: cache_row_bytes(opts.kv_cache_dtype),
            mtp_drafts: opts.mtp_drafts,
        };
        let cache_layers = inputs.cache_layers();
        let MemoryPlan { activations, mode, step_limits, activation_bytes, num_blocks } =
            memory_plan::plan(dev, inputs)?;
        let Activations { ws, linears, meta, lim, .. } = activations;
        let cache =
            DeviceBuffer::alloc((num_blocks + 1) * PAGE_SIZE * cache_layers * cache_row_bytes(opts.kv_cache_dtype))?;
        let inv_freq = DeviceBuffer::from_host(&cfg.rope_inv_freq())?;
        let s = lim.max_seqs;
        Ok(CudaModel {
            scale: cfg.softmax_scale() as f32,
            attn_factor: cfg.rope_attention_factor() as f32,
            eps: cfg.rms_norm_eps as f32,
            route: RouteParams::of(&cfg),
            cfg,
            weights,
            ws,
            cache,
            cache_dtype: opts.kv_cache_dtype,
            num_blocks,
            inv_freq,
            meta,
            host_tokens: PinnedBuffer::alloc(s)?,
            host_logprobs: PinnedBuffer::alloc(s)?,
            host_top_ids: PinnedBuffer::alloc(s * MAX_TOP_LOGPROBS)?,
            host_top_lps: PinnedBuffer::alloc(s * MAX_TOP_LOGPROBS)?,
            lim,
            max_model_len,
            activation_bytes,
            decode_splits_override: None,
            forced_acceptance: None,
            pending_verdict: None,
            linears,
            mode,
            step_limits,
        })
    }

    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// The private block padding rows of a graph-replayed decode batch use.
    pub fn pad_block(&self) -> usize {
        self.num_blocks
    }

    /// Layers of the latent cache: the model's, then the MTP module's when it is loaded.
    pub fn cache_layers(&self) -> usize {
        self.cfg.num_hidden_layers + usize::from(self.weights.mtp.is_some())
    }

    /// Bytes one token takes in every layer's cache together.
    pub fn cache_bytes_per_token(&self) -> usize {
        self.cache_layers() * cache_row_bytes(self.cache_dtype)
    }

    /// One layer's cache (every block, the padding block included).
    pub fn layer_cache(&self, layer: usize) -> LatentCacheSlice<'_> {
        let per = (self.num_blocks + 1) * PAGE_SIZE * cache_row_bytes(self.cache_dtype);
        LatentCacheSlice { bytes: self.cache.sub(layer * per, per), dtype: self.cache_dtype }
    }

    /// Words of the metadata buffer every decode step (and every captured graph) reads.
    pub fn graph_meta_words(&self) -> usize {
        self.meta.fixed_words()
    }

    /// Runs one step: validate, upload metadata, queue the forward pass, read results. A step
    /// that asks for speculative decoding runs its verify and draft passes (`speculative`).
    /// Checks `plan` against this rank's cache and the model, and scored rows against what
    /// the device reports (the server caps `--max-logprobs` at that on CUDA).
    pub(super) fn validate(&self, plan: &StepPlan) -> anyhow::Result<()> {
        plan.validate(PAGE_SIZE, self.num_blocks, self.cfg.vocab_size, self.max_model_len)?;
        for s in &plan.seqs {
            if let LogitsRequest::Scored { top, .. } = s.logits {
                anyhow::ensure!(
                    top as usize <= MAX_TOP_LOGPROBS,
                    "sequence {}: the device scores at most {MAX_TOP_LOGPROBS} alternatives, not {top}",
                    s.seq_id
                );
            }
        }
        Ok(())
    }

    pub fn step(&mut self, dev: &Device, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        if plan.has_speculative() {
            return self.step_speculative(dev, None, plan, None);
        }
        self.run_eager(dev, plan, FfnRows::Padded(plan.num_tokens()))
    }

    /// `step` for a rank of a DP-attention group run eagerly: rank r feeds `counts[r]` tokens
    /// (this rank its plan's), which its FFN collectives carry packed. An empty plan is an idle
    /// rank: it still runs every layer's FFN and its collectives.
    pub fn step_rank(&mut self, dev: &Device, plan: &StepPlan, counts: &[usize]) -> anyhow::Result<StepOutput> {
        let rank = self.mode.comm().map_or(0, |c| c.rank());
        anyhow::ensure!(
            counts.get(rank) == Some(&plan.num_tokens()),
            "rank {rank} feeds {} tokens but the step's counts are {counts:?}",
            plan.num_tokens()
        );
        self.run_eager(dev, plan, FfnRows::Packed(counts))
    }

    pub(super) fn run_eager(&mut self, dev: &Device, plan: &StepPlan, rows: FfnRows) -> anyhow::Result<StepOutput> {
        self.validate(plan)?;
        anyhow::ensure!(!plan.has_speculative(), "speculative steps run through CudaModel::step");
        settled(dev, self.queue_forks(dev, plan))?;
        if plan.seqs.is_empty() {
            if self.mode.is_dp_attention() {
                let r = self.queue_idle(dev, rows).and_then(|()| Ok(dev.gpu.sync()?));
                if r.is_err() {
                    let _ = dev.gpu.sync();
                }
                r?;
            }
            return Ok(StepOutput::default());
        }
        let mut meta = StepMeta::build(plan, &self.lim)?;
        let run = |me: &mut Self, meta: &mut StepMeta| -> anyhow::Result<StepOutput> {
            me.upload_meta(dev, meta)?;
            let splits = me.default_decode_splits(dev, meta);
            // The forward pass is queued before the structured-output masks are waited for, so
            // the engine computes them while the device runs it.
            me.queue_model(dev, meta, splits, rows)?;
            me.upload_masks(dev, meta)?;
            me.queue_sampler(dev, meta)?;
            me.read_outputs(dev, meta)
        };
        settled(dev, run(self, &mut meta))
    }

    /// Decode splits for the step's decode rows (those of a mixed step alone: the prompt chunks
    /// take no part in the decode launch).
    pub fn default_decode_splits(&self, dev: &Device, meta: &StepMeta) -> usize {
        let (batch, max_pages) = meta.decode().map_or((meta.seqs, 1), |d| (d.batch, d.max_pages));
        self.decode_splits_override
            .unwrap_or_else(|| dev.k.attention.splits(batch, self.cfg.num_attention_heads, max_pages))
    }

    /// Decode splits a graph captured for `batch` sequences uses (valid for any context length).
    pub fn graph_decode_splits(&self, dev: &Device, batch: usize) -> usize {
        dev.k.attention.splits(batch, self.cfg.num_attention_heads, self.lim.max_blocks_per_seq)
    }

    /// Queues the copies of the step's metadata, penalty and bias entries (see `MetaBuffers`).
    pub fn upload_meta(&mut self, dev: &Device, meta: &mut StepMeta) -> anyhow::Result<()> {
        self.meta.upload(dev, meta)
    }

    /// Waits for the step's structured-output masks and queues their copy (see `MetaBuffers`);
    /// nothing to do for a step without masks. Between the forward pass and the sampler.
    pub fn upload_masks(&mut self, dev: &Device, meta: &StepMeta) -> anyhow::Result<()> {
        self.meta.upload_masks(dev, meta)
    }

    /// Queues the whole forward pass and sampling for an uploaded step (graph-capturable): a
    /// step whose masks are uploaded already, or one without masks.
    /// `ffn_rows` is how the FFN collectives of DP attention lay out the ranks' rows; other
    /// modes ignore it.
    pub fn queue_forward(
        &self,
        dev: &Device,
        m: &StepMeta,
        decode_splits: usize,
        ffn_rows: FfnRows,
    ) -> anyhow::Result<()> {
        self.queue_model(dev, m, decode_splits, ffn_rows)?;
        self.queue_sampler(dev, m)
    }

    /// Queues the forward pass up to the logits, without the sampler (`queue_forward`).
    pub fn queue_model(
        &self,
        dev: &Device,
        m: &StepMeta,
        decode_splits: usize,
        ffn_rows: FfnRows,
    ) -> anyhow::Result<()> {
        let (s, k) = (dev.stream(), &dev.k);
        let cfg = &self.cfg;
        let (t, hidden) = (m.tokens, cfg.hidden_size);
        let ws = &self.ws;
        let words = self.meta.words_for(m.words.len());
        let embedding = Embedding {
            table: self.weights.embed.lin().w,
            vocab: cfg.vocab_size,
            ids: m.token_ids.on(words),
            out: ws.residual.slice(),
            tokens: t,
            hidden,
        };
        k.elementwise.embedding(s, &embedding)?;
        let mut ffn_delta = NormDelta::Bf16(ws.ffn_out.slice());
        for (l, lw) in self.weights.layers.iter().enumerate() {
            if l == 0 {
                let norm = RmsNormF32 {
                    x: ws.residual.slice(),
                    weight: lw.input_norm.slice(),
                    out: ws.h.slice(),
                    rows: t,
                    hidden,
                    eps: self.eps,
                };
                k.elementwise.rmsnorm_f32(s, &norm)?;
            } else {
                self.add_norm(dev, ffn_delta, lw.input_norm.slice(), t)?;
            }
            self.attention(dev, lw, l, m, words, decode_splits)?;
            let attn_delta = self.mode.attention_output(dev, ws.delta.slice(), t, hidden)?;
            self.add_norm(dev, attn_delta, lw.post_norm.slice(), t)?;
            ffn_delta = self.ffn(dev, &lw.ffn, t, ffn_rows)?;
        }
        self.add_norm(dev, ffn_delta, self.weights.norm.slice(), t)?;
        self.queue_head(dev, m, words)
    }

    /// The output projection of the rows of `ws.h` the step wants logits of.
    pub(super) fn queue_head(&self, dev: &Device, m: &StepMeta, words: DSlice<i32>) -> anyhow::Result<()> {
        let (ws, hidden) = (&self.ws, self.cfg.hidden_size);
        let r = m.logit_rows();
        if r > 0 {
            let src = m.logit_src.on(words);
            dev.k.elementwise.gather_rows(dev.stream(), ws.h.slice(), src, ws.h_rows.slice(), r, hidden)?;
            let v = self.cfg.vocab_size;
            let head = self.weights.output_projection();
            self.linears.linear_f32_out(dev, &head, rows(&ws.h_rows, hidden), r, rows(&ws.logits, v))?;
        }
        Ok(())
    }

    /// Queues the sampler over the step's logits rows (after `queue_model`, and after
    /// `upload_masks` when the step has masks). One launch; none for a step that samples nothing.
    /// A pending verdict on sampled drafts runs first and decides its rows' tokens.
    pub fn queue_sampler(&self, dev: &Device, m: &StepMeta) -> anyhow::Result<()> {
        let (s, k) = (dev.stream(), &dev.k);
        let ws = &self.ws;
        let cfg = &self.cfg;
        let words = self.meta.words_for(m.words.len());
        if let Some((n_rows, n_verdicts)) = self.pending_verdict {
            let store = &ws.mtp.as_ref().expect("a verdict is pending only with the MTP module").drafts;
            let v = Verdicts {
                rows: store.spec_rows.slice(),
                n_rows,
                dists: store.dists.slice(),
                verdicts: store.verdicts.slice(),
                n_verdicts,
                logits: ws.logits.slice(),
                stride: cfg.vocab_size,
                vocab: cfg.vocab_size,
                params: m.sampling.on(words),
                penalty_table: m.penalty_table.on(words),
                bias_table: m.bias_table.on(words),
                mask_table: self.meta.mask_table(),
                work: ws.sample_work.slice(),
            };
            k.speculative.verdicts(s, &v)?;
        }
        if m.sample_rows > 0 {
            let out = SamplerOutputs {
                token: ws.sampled_token.slice(),
                logprob: ws.sampled_logprob.slice(),
                top_ids: ws.top_ids.slice(),
                top_lps: ws.top_lps.slice(),
            };
            let p = Sample {
                logits: ws.logits.slice(),
                stride: cfg.vocab_size,
                rows: m.sample_rows,
                vocab: cfg.vocab_size,
                params: m.sampling.on(words),
                penalty_table: m.penalty_table.on(words),
                bias_table: m.bias_table.on(words),
                mask_table: self.meta.mask_table(),
                work: ws.sample_work.slice(),
                out,
            };
            k.sampling.sample(s, &p)?;
        }
        let n = m.scored_rows();
        if n > 0 {
            let scores = Scores {
                logits: ws.logits.slice(),
                stride: cfg.vocab_size,
                vocab: cfg.vocab_size,
                rows: m.scored.on(words),
                n,
                out: ScoreOutputs {
                    logprob: ws.score_logprob.slice(),
                    rank: ws.score_rank.slice(),
                    top_ids: ws.score_top_ids.slice(),
                    top_lps: ws.score_top_lps.slice(),
                },
            };
            k.sampling.score_rows(s, &scores)?;
        }
        Ok(())
    }

    /// An idle DP-attention rank's step: no rows of its own, but every FFN layer's gather, FFN
    /// share and reduce-scatter, so the ranks with work are not left waiting. The rows it sends
    /// are whatever its activation buffer holds (finite: zeroed at start, normed rows since);
    /// nothing reads what comes back.
    fn queue_idle(&self, dev: &Device, rows: FfnRows) -> anyhow::Result<()> {
        for lw in &self.weights.layers {
            self.ffn(dev, &lw.ffn, 0, rows)?;
        }
        Ok(())
    }

    /// `residual += delta; h = rmsnorm(residual) * weight` over the step's rows.
    pub(super) fn add_norm(
        &self,
        dev: &Device,
        delta: NormDelta,
        weight: DSlice<bf16>,
        t: usize,
    ) -> anyhow::Result<()> {
        let p = AddRmsNorm {
            residual: self.ws.residual.slice(),
            delta,
            weight,
            out: self.ws.h.slice(),
            rows: t,
            hidden: self.cfg.hidden_size,
            eps: self.eps,
        };
        dev.k.elementwise.add_rmsnorm(dev.stream(), &p)
    }

    /// Copies sampled tokens (and requested logits) back and assembles the step's output. The
    /// only host synchronisation of a step.
    pub fn read_outputs(&mut self, dev: &Device, m: &StepMeta) -> anyhow::Result<StepOutput> {
        let st = dev.stream();
        let n = m.sample_rows;
        if n > 0 {
            let ws = &self.ws;
            self.host_tokens.copy_from_device(0, ws.sampled_token.sub(0, n), st)?;
            self.host_logprobs.copy_from_device(0, ws.sampled_logprob.sub(0, n), st)?;
            self.host_top_ids.copy_from_device(0, ws.top_ids.sub(0, n * MAX_TOP_LOGPROBS), st)?;
            self.host_top_lps.copy_from_device(0, ws.top_lps.sub(0, n * MAX_TOP_LOGPROBS), st)?;
        }
        dev.gpu.sync()?;
        let v = self.cfg.vocab_size;
        let logits = if m.outputs.iter().any(|o| !o.logit_rows.is_empty()) {
            crate::gpu::download_slice(self.ws.logits.sub(0, m.logit_rows() * v))?
        } else {
            vec![]
        };
        let scores = self.read_scores(m)?;
        let (toks, lps) = (self.host_tokens.as_slice(), self.host_logprobs.as_slice());
        let (tids, tlps) = (self.host_top_ids.as_slice(), self.host_top_lps.as_slice());
        let seqs = m
            .outputs
            .iter()
            .map(|o| SeqResult {
                seq_id: o.seq_id,
                logits: o.logit_rows.iter().map(|&r| logits[r * v..(r + 1) * v].to_vec()).collect(),
                scores: scores[o.scores.clone()].to_vec(),
                sampled: o.sample_row.map(|r| SampledToken {
                    token: toks[r] as u32,
                    logprob: if o.top_logprobs.is_some() { lps[r] } else { 0.0 },
                    top_logprobs: (0..o.top_logprobs.unwrap_or(0))
                        .map(|j| (tids[r * MAX_TOP_LOGPROBS + j] as u32, tlps[r * MAX_TOP_LOGPROBS + j]))
                        .collect(),
                }),
                extra_tokens: vec![],
                drafts: vec![],
            })
            .collect();
        Ok(StepOutput { seqs })
    }

    /// The scores of the step's scored rows, once the step has run: a few words per row
    /// (`ScoreOutputs`), the alternatives as many as each row asked for.
    fn read_scores(&self, m: &StepMeta) -> anyhow::Result<Vec<RowScore>> {
        let n = m.scored_rows();
        if n == 0 {
            return Ok(vec![]);
        }
        let ws = &self.ws;
        let lps = crate::gpu::download_slice(ws.score_logprob.sub(0, n))?;
        let ranks = crate::gpu::download_slice(ws.score_rank.sub(0, n))?;
        let ids = crate::gpu::download_slice(ws.score_top_ids.sub(0, n * MAX_TOP_LOGPROBS))?;
        let tops = crate::gpu::download_slice(ws.score_top_lps.sub(0, n * MAX_TOP_LOGPROBS))?;
        let asked = m.scored.read(&m.words);
        Ok((0..n)
            .map(|i| {
                let k = asked[i * SCORE_ROW_WORDS + 2] as usize;
                let at = i * MAX_TOP_LOGPROBS..i * MAX_TOP_LOGPROBS + k;
                RowScore { logprob: lps[i], rank: ranks[i] as u32, top: at.map(|j| (ids[j] as u32, tops[j])).collect() }
            })
            .collect())
    }
}
