//! One forward step: embedding, the decoder layers (MLA attention on the normal path for prefill
//! and the absorbed path for decode, dense MLP or DeepSeekMoE), the final norm, the output
//! projection for the rows that need logits, and device sampling.
//!
//! `queue_forward` only queues work on the stream: no allocation, no synchronisation, no host
//! reads of device data, so a decode step can be captured as a CUDA graph as is.

use super::memory_plan::{self, Activations, BudgetFit, MemoryPlan, PlanInputs};
use super::meta::{DecodeLayout, MetaLimits, PrefillLayout, StepLayout, StepMeta};
use super::meta_buffers::MetaBuffers;
use super::moe_small::{self, MoeSmallIo};
use super::small_linear::SmallLinear;
use super::weights::{DeviceWeights, FfnWeights, MlpWeights, MoeWeights, QueryWeights};
use super::workspace::{CollectiveBuffers, CollectiveKind, Workspace};
use crate::device::Device;
use crate::gpu::nccl::NcclComm;
use crate::gpu::{DSlice, DeviceBuffer, PinnedBuffer};
use crate::ops::{
    AbsorbQ, AddRmsNorm, DecodeAttention, Embedding, GroupedGateUp, GroupedGemm, GroupedInput, Linear, NormDelta,
    PrefillAttention, PrefillPass, RmsNormBf16, RmsNormF32, RopeCache, RouteParams, Sample, SamplerOutputs, Strided,
    COMBINE_ABSORB_MAX_BATCH, LATENT, MAX_TOP_LOGPROBS, NOPE, PAGE_SIZE, ROPE, V_HEAD,
};
use half::bf16;
use mla_core::plan::{SampledToken, SeqResult, StepOutput, StepPlan};
use mla_core::{ModelConfig, StepLimits};

#[derive(Debug, Clone)]
pub struct ModelOptions {
    /// The largest step the flags ask for (`mla_core::StepLimits::derive`); the memory planner
    /// may halve its token budget (`memory_plan`).
    pub step_limits: StepLimits,
    /// Whether the token budget may shrink to make room for the KV cache.
    pub fit: BudgetFit,
    /// Tokens the KV cache should hold before a default budget is kept (`memory_plan`).
    pub kv_goal_tokens: usize,
    /// Cached keys decompressed per prefill pass (at least a step's tokens).
    pub max_kv_chunk: usize,
    /// Fraction of device memory for weights, activations and the KV cache together.
    pub gpu_memory_utilization: f64,
    /// Fixed cache size in blocks instead of sizing from memory (tests).
    pub num_blocks: Option<usize>,
    /// Longest sequence (prompt + output) the backend accepts.
    pub max_model_len: usize,
    /// Single-row projections through the weight-streaming GEMV instead of cuBLAS (`SmallLinear`).
    pub small_batch_gemv: bool,
    /// FP8 projections of steps past the GEMV's rows in W8A8 through cuBLASLt's block-scaled GEMM
    /// (sm_90 only); off, or on other GPUs, they dequantize to bf16 for cuBLAS (`SmallLinear`).
    pub fp8_w8a8: bool,
}

impl ModelOptions {
    /// Options for a fixed step shape and cache (tests and benchmarks): `tokens` per step,
    /// `seqs` sequences, `logit_rows` rows of logits, one rank.
    pub fn fixed(tokens: usize, seqs: usize, logit_rows: usize, max_kv_chunk: usize) -> Self {
        ModelOptions {
            step_limits: StepLimits {
                rank_tokens: tokens,
                rank_seqs: seqs,
                rank_logit_rows: logit_rows,
                gathered_ranks: 1,
            },
            fit: BudgetFit::Fixed,
            kv_goal_tokens: 0,
            max_kv_chunk,
            gpu_memory_utilization: 0.9,
            num_blocks: None,
            max_model_len: usize::MAX,
            small_batch_gemv: true,
            fp8_w8a8: true,
        }
    }
}

/// How a model's forward pass relates to other ranks. The config a rank is built with is its own
/// share (`RankLayout::local_config`): its heads and FFN widths.
pub enum RankMode {
    /// The whole model on one device: no collectives.
    Single,
    /// Tensor parallel: every rank runs the same rows with its share of the heads and FFN
    /// widths; the bf16 partial outputs of attention and FFN are widened and all-reduced in f32
    /// and added to the f32 residual.
    TensorParallel(NcclComm),
    /// DP attention: the whole attention for this rank's own rows; before each FFN every rank's
    /// normed rows (padded to the step's largest rank) are all-gathered, the FFN runs with this
    /// rank's share of the widths over all of them, and a reduce-scatter in f32 returns the sums
    /// for this rank's rows.
    DpAttention(NcclComm),
}

impl RankMode {
    fn collective_kind(&self) -> CollectiveKind {
        match self {
            RankMode::Single => CollectiveKind::None,
            RankMode::TensorParallel(_) => CollectiveKind::TensorParallel,
            RankMode::DpAttention(_) => CollectiveKind::DpAttention,
        }
    }

    pub fn comm(&self) -> Option<&NcclComm> {
        match self {
            RankMode::Single => None,
            RankMode::TensorParallel(c) | RankMode::DpAttention(c) => Some(c),
        }
    }

    pub fn is_dp_attention(&self) -> bool {
        matches!(self, RankMode::DpAttention(_))
    }
}

/// How a DP-attention step's FFN collectives lay out the ranks' rows.
#[derive(Debug, Clone, Copy)]
pub enum FfnRows<'a> {
    /// Every rank sends this many rows (its own, then padding): graph replays, whose collective
    /// sizes are fixed at capture.
    Padded(usize),
    /// Rank r sends `counts[r]` rows, packed without padding: eager steps, where ranks may feed
    /// very different numbers of tokens (one prefills while another decodes).
    Packed(&'a [usize]),
}

/// Decode steps of at most this many tokens absorb the queries inside the rope/cache launch
/// (one launch instead of two; the cuBLAS batched GEMM wins beyond a few tokens).
const SMALL_DECODE_TOKENS: usize = 4;

pub struct CudaModel {
    pub cfg: ModelConfig,
    pub weights: DeviceWeights,
    pub ws: Workspace,
    /// [layers][(num_blocks + 1) * PAGE_SIZE][kv_lora_rank + qk_rope]
    pub cache: DeviceBuffer<bf16>,
    /// Blocks the block manager may use; block `num_blocks` (`pad_block`) is private: the rows
    /// that pad a decode batch up to a captured graph's size write and read only it.
    pub num_blocks: usize,
    inv_freq: DeviceBuffer<f32>,
    meta: MetaBuffers,
    host_tokens: PinnedBuffer<i32>,
    host_logprobs: PinnedBuffer<f32>,
    host_top_ids: PinnedBuffer<i32>,
    host_top_lps: PinnedBuffer<f32>,
    pub lim: MetaLimits,
    pub max_model_len: usize,
    scale: f32,
    attn_factor: f32,
    eps: f32,
    route: RouteParams,
    /// Bytes measured for the activation workspace (cuMemGetInfo before/after allocating it).
    pub activation_bytes: usize,
    /// Forces the decode split count (tests comparing eager steps with a captured graph).
    pub decode_splits_override: Option<usize>,
    /// Which kernel runs the dense projections of small steps.
    pub linears: SmallLinear,
    pub mode: RankMode,
    /// The largest step this rank was sized for (after the memory planner).
    pub step_limits: StepLimits,
}

/// What both attention paths of one layer read besides the activations.
struct LayerAttention<'a> {
    /// The layer's slice of the latent cache.
    cache: DSlice<'a, bf16>,
    kv_b: Linear<'a>,
    /// The step's metadata on the device.
    words: DSlice<'a, i32>,
}

/// Activations as `Strided` rows of `width` (packed).
fn rows<T>(buf: &DeviceBuffer<T>, width: usize) -> Strided<'_, T> {
    Strided::new(buf.slice(), width)
}

impl CudaModel {
    pub fn new(dev: &Device, cfg: ModelConfig, weights: DeviceWeights, opts: &ModelOptions) -> anyhow::Result<Self> {
        Self::new_rank(dev, cfg, weights, opts, RankMode::Single)
    }

    /// A rank of a group: `cfg` is the rank's own share and `mode` says how it meets the others.
    /// Every rank of the group (on every node) takes the smallest KV cache any of them has room
    /// for, so all ranks of a step see the same cache.
    pub fn new_rank(
        dev: &Device,
        cfg: ModelConfig,
        weights: DeviceWeights,
        opts: &ModelOptions,
        mode: RankMode,
    ) -> anyhow::Result<Self> {
        super::check_supported(&cfg)?;
        dev.gpu.sync()?;
        let max_model_len = opts.max_model_len.min(cfg.max_position_embeddings).max(1);
        let gathered = mode.comm().filter(|_| mode.is_dp_attention()).map_or(1, NcclComm::world);
        anyhow::ensure!(
            opts.step_limits.gathered_ranks == gathered,
            "step limits gather {} ranks' rows, but this rank's FFN gathers {gathered}",
            opts.step_limits.gathered_ranks
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
            kind: mode.collective_kind(),
            comm: mode.comm(),
            weight_bytes: weights.bytes(),
        };
        let MemoryPlan { activations, step_limits, activation_bytes, num_blocks } = memory_plan::plan(dev, &inputs)?;
        let Activations { ws, linears, meta, lim } = activations;
        let cache = DeviceBuffer::alloc((num_blocks + 1) * PAGE_SIZE * cfg.num_hidden_layers * cfg.kv_cache_dim())?;
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

    fn layer_cache(&self, layer: usize) -> DSlice<'_, bf16> {
        let per = (self.num_blocks + 1) * PAGE_SIZE * self.cfg.kv_cache_dim();
        self.cache.sub(layer * per, per)
    }

    /// Words of the metadata buffer every decode step (and every captured graph) reads.
    pub fn graph_meta_words(&self) -> usize {
        self.meta.fixed_words()
    }

    /// Runs one step: validate, upload metadata, queue the forward pass, read results.
    pub fn step(&mut self, dev: &Device, plan: &StepPlan) -> anyhow::Result<StepOutput> {
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

    fn run_eager(&mut self, dev: &Device, plan: &StepPlan, rows: FfnRows) -> anyhow::Result<StepOutput> {
        plan.validate(PAGE_SIZE, self.num_blocks, self.cfg.vocab_size, self.max_model_len)?;
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
        let out = run(self, &mut meta);
        if out.is_err() {
            // Leave no copy or kernel of the failed step in flight.
            let _ = dev.gpu.sync();
        }
        out
    }

    pub fn default_decode_splits(&self, dev: &Device, meta: &StepMeta) -> usize {
        let max_pages = meta.decode().map_or(1, |d| d.max_pages);
        self.decode_splits_override
            .unwrap_or_else(|| dev.k.attention.splits(meta.seqs, self.cfg.num_attention_heads, max_pages))
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
            self.attention(dev, l, m, words, decode_splits)?;
            let attn_delta = self.attention_sum(dev, t)?;
            self.add_norm(dev, attn_delta, lw.post_norm.slice(), t)?;
            ffn_delta = self.ffn(dev, &lw.ffn, t, ffn_rows)?;
        }
        self.add_norm(dev, ffn_delta, self.weights.norm.slice(), t)?;
        let r = m.logit_rows();
        if r > 0 {
            k.elementwise.gather_rows(s, ws.h.slice(), m.logit_src.on(words), ws.h_rows.slice(), r, hidden)?;
            let v = cfg.vocab_size;
            let head = self.weights.output_projection();
            self.linears.linear_f32_out(dev, &head, rows(&ws.h_rows, hidden), r, rows(&ws.logits, v))?;
        }
        Ok(())
    }

    /// Queues the sampler over the step's logits rows (after `queue_model`, and after
    /// `upload_masks` when the step has masks). One launch; none for a step that samples nothing.
    pub fn queue_sampler(&self, dev: &Device, m: &StepMeta) -> anyhow::Result<()> {
        let (s, k) = (dev.stream(), &dev.k);
        let ws = &self.ws;
        let cfg = &self.cfg;
        let words = self.meta.words_for(m.words.len());
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

    /// The attention output to add to the residual: the bf16 `delta`, or under tensor
    /// parallelism the f32 sum of every rank's partial `delta`.
    fn attention_sum(&self, dev: &Device, t: usize) -> anyhow::Result<NormDelta<'_>> {
        let ws = &self.ws;
        match (&self.mode, &ws.collective) {
            (RankMode::TensorParallel(comm), Some(CollectiveBuffers::TensorParallel { delta_f32, .. })) => {
                let n = t * self.cfg.hidden_size;
                let sum = delta_f32.sub(0, n);
                dev.k.elementwise.bf16_to_f32(dev.stream(), ws.delta.sub(0, n), sum, n)?;
                comm.all_reduce_sum_f32(sum, dev.stream())?;
                Ok(NormDelta::F32(sum))
            }
            _ => Ok(NormDelta::Bf16(ws.delta.slice())),
        }
    }

    /// One layer's FFN (dense MLP or MoE) over the step's `t` rows with its collectives;
    /// returns what to add to the residual. `rows` lays out DP attention's gathered rows.
    fn ffn(&self, dev: &Device, ffn: &FfnWeights, t: usize, rows: FfnRows) -> anyhow::Result<NormDelta<'_>> {
        let ws = &self.ws;
        let (s, hidden) = (dev.stream(), self.cfg.hidden_size);
        let run = |x: DSlice<bf16>, rows: usize, out: DSlice<bf16>| match ffn {
            FfnWeights::Dense(mlp) => self.mlp(dev, mlp, x, rows, out),
            FfnWeights::Moe(moe) => self.moe(dev, moe, x, rows, out),
        };
        match (&self.mode, &ws.collective) {
            (RankMode::Single, _) => {
                run(ws.h.slice(), t, ws.ffn_out.slice())?;
                Ok(NormDelta::Bf16(ws.ffn_out.slice()))
            }
            (RankMode::TensorParallel(comm), Some(CollectiveBuffers::TensorParallel { ffn_f32, .. })) => {
                run(ws.h.slice(), t, ws.ffn_out.slice())?;
                let n = t * hidden;
                let sum = ffn_f32.sub(0, n);
                dev.k.elementwise.bf16_to_f32(s, ws.ffn_out.sub(0, n), sum, n)?;
                comm.all_reduce_sum_f32(sum, s)?;
                Ok(NormDelta::F32(sum))
            }
            (
                RankMode::DpAttention(comm),
                Some(CollectiveBuffers::DpAttention { h_all, ffn_all, ffn_all_f32, ffn_f32 }),
            ) => {
                let (rank, world) = (comm.rank(), comm.world());
                // Elements each rank sends: padded to one size, or its own rows packed.
                let elems: Vec<usize> = match rows {
                    FfnRows::Padded(r) => vec![r * hidden; world],
                    FfnRows::Packed(counts) => counts.iter().map(|c| c * hidden).collect(),
                };
                let (mine, all) = (elems[rank], elems.iter().sum::<usize>());
                match rows {
                    FfnRows::Padded(_) => comm.all_gather_bf16(ws.h.sub(0, mine), h_all.sub(0, all), s)?,
                    FfnRows::Packed(_) => comm.all_gather_v_bf16(ws.h.sub(0, mine), h_all.sub(0, all), &elems, s)?,
                }
                run(h_all.sub(0, all), all / hidden, ffn_all.sub(0, all))?;
                dev.k.elementwise.bf16_to_f32(s, ffn_all.sub(0, all), ffn_all_f32.sub(0, all), all)?;
                match rows {
                    FfnRows::Padded(_) => {
                        comm.reduce_scatter_sum_f32(ffn_all_f32.sub(0, all), ffn_f32.sub(0, mine), s)?
                    }
                    FfnRows::Packed(_) => {
                        comm.reduce_scatter_v_sum_f32(ffn_all_f32.sub(0, all), ffn_f32.sub(0, mine), &elems, s)?
                    }
                }
                Ok(NormDelta::F32(ffn_f32.sub(0, mine)))
            }
            _ => unreachable!("the workspace's collective buffers follow the rank mode"),
        }
    }

    /// `residual += delta; h = rmsnorm(residual) * weight` over the step's rows.
    fn add_norm(&self, dev: &Device, delta: NormDelta, weight: DSlice<bf16>, t: usize) -> anyhow::Result<()> {
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

    fn attention(
        &self,
        dev: &Device,
        l: usize,
        m: &StepMeta,
        words: DSlice<i32>,
        decode_splits: usize,
    ) -> anyhow::Result<()> {
        let (s, k) = (dev.stream(), &dev.k);
        let cfg = &self.cfg;
        let ws = &self.ws;
        let lw = &self.weights.layers[l];
        let (t, hidden, heads) = (m.tokens, cfg.hidden_size, cfg.num_attention_heads);
        let (qd, lat) = (NOPE + ROPE, LATENT + ROPE);
        let h = rows(&ws.h, hidden);
        // q (or q_a) and kv_a both read h: one launch at small batch.
        let kv_a = lw.kv_a.proj();
        match &lw.query {
            QueryWeights::Direct(q) => self.linears.linear_pair(
                dev,
                h,
                t,
                (&q.proj(), rows(&ws.q, heads * qd)),
                (&kv_a, rows(&ws.kva, lat)),
            )?,
            QueryWeights::LowRank { a, a_norm, b } => {
                let r = a.out;
                self.linears.linear_pair(dev, h, t, (&a.proj(), rows(&ws.q_a, r)), (&kv_a, rows(&ws.kva, lat)))?;
                let norm = RmsNormBf16 {
                    x: ws.q_a.slice(),
                    x_stride: r,
                    weight: a_norm.slice(),
                    out: ws.q_a_normed.slice(),
                    out_stride: r,
                    rows: t,
                    width: r,
                    eps: self.eps,
                };
                k.elementwise.rmsnorm_bf16(s, &norm)?;
                self.linears.linear(dev, &b.proj(), rows(&ws.q_a_normed, r), t, rows(&ws.q, heads * qd))?;
            }
        }
        let cache = self.layer_cache(l);
        let kv_b = lw.kv_b.lin();
        // Small decode steps absorb the queries in the rope/cache launch (latent_cache.cu).
        let decode = matches!(m.layout, StepLayout::Decode(_));
        let absorb_in_rope = decode && t <= SMALL_DECODE_TOKENS;
        let rope = RopeCache {
            tokens: t,
            heads,
            nope: NOPE,
            kv_lora_rank: LATENT,
            rope_dim: ROPE,
            kva: ws.kva.slice(),
            kva_stride: lat,
            kv_norm_w: lw.kv_a_norm.slice(),
            q: ws.q.slice(),
            q_stride: heads * qd,
            q_pe_out: decode.then(|| (ws.q_abs.slice().tail(LATENT), heads * lat, lat)),
            positions: m.positions.on(words),
            slots: m.slots.on(words),
            inv_freq: self.inv_freq.slice(),
            attn_factor: self.attn_factor,
            eps: self.eps,
            cache,
            absorb: absorb_in_rope.then(|| AbsorbQ {
                kv_b: kv_b.w,
                v_dim: V_HEAD,
                q_abs: ws.q_abs.slice(),
                row_stride: heads * lat,
                head_stride: lat,
            }),
        };
        k.latent.rope_cache(s, &rope)?;
        let layer = LayerAttention { cache, kv_b, words };
        match &m.layout {
            StepLayout::Decode(d) => {
                if !absorb_in_rope {
                    dev.blas.absorb_q(&kv_b, heads, ws.q.slice(), t, ws.q_abs.slice())?;
                }
                self.decode_attention(dev, d, t, &layer, decode_splits)?;
            }
            StepLayout::Prefill(p) => self.prefill_attention(dev, p, m, &layer)?,
        }
        self.linears.linear(dev, &lw.o_proj.proj(), rows(&ws.attn_out, heads * V_HEAD), t, rows(&ws.delta, hidden))?;
        Ok(())
    }

    /// The absorbed path: attention over the latent cache in latent space, then W_UV.
    fn decode_attention(
        &self,
        dev: &Device,
        d: &DecodeLayout,
        t: usize,
        layer: &LayerAttention,
        decode_splits: usize,
    ) -> anyhow::Result<()> {
        let (s, k, ws) = (dev.stream(), &dev.k, &self.ws);
        let (cache, kv_b, words) = (layer.cache, &layer.kv_b, layer.words);
        let p = DecodeAttention {
            batch: t,
            heads: self.cfg.num_attention_heads,
            q: ws.q_abs.slice(),
            cache,
            block_tables: d.block_tables.on(words),
            bt_stride: d.bt_stride.on(words),
            seq_lens: d.seq_lens.on(words),
            num_splits: decode_splits,
            out: ws.o_lat.slice(),
            part_o: ws.part_o.slice(),
            part_lse: ws.part_lse.slice(),
            scale: self.scale,
        };
        if t <= COMBINE_ABSORB_MAX_BATCH {
            // Small steps: the split merge and W_UV in one launch after the partials.
            k.attention.decode_partials(s, &p)?;
            k.attention.decode_combine_absorb_o(s, &p.partials(), kv_b, ws.attn_out.slice())
        } else {
            k.attention.decode(s, &p)?;
            dev.blas.absorb_o(kv_b, p.heads, ws.o_lat.slice(), t, ws.attn_out.slice())
        }
    }

    /// The normal path: per pass over a window of cached keys, decompress them through kv_b and
    /// run causal flash attention, carrying the running state between passes.
    fn prefill_attention(
        &self,
        dev: &Device,
        p: &PrefillLayout,
        m: &StepMeta,
        layer: &LayerAttention,
    ) -> anyhow::Result<()> {
        let (s, k, ws) = (dev.stream(), &dev.k, &self.ws);
        let (cache, kv_b, words) = (layer.cache, &layer.kv_b, layer.words);
        let heads = self.cfg.num_attention_heads;
        let (qd, lat, kvw) = (NOPE + ROPE, LATENT + ROPE, heads * (NOPE + V_HEAD));
        for pass in &p.passes {
            k.elementwise.gather_rows(s, cache, pass.slots.on(words), ws.latent.slice(), pass.keys, lat)?;
            dev.blas.linear(kv_b, rows(&ws.latent, lat), pass.keys, rows(&ws.kv, kvw))?;
            let a = PrefillAttention {
                heads,
                q_rows: m.tokens,
                q: ws.q.slice(),
                q_stride: heads * qd,
                k_rows: pass.keys,
                kv: ws.kv.slice(),
                kv_stride: kvw,
                kpe: ws.latent.slice().tail(LATENT),
                kpe_stride: lat,
                out: ws.attn_out.slice(),
                out_stride: heads * V_HEAD,
                state_o: ws.state_o.slice(),
                state_ml: ws.state_ml.slice(),
                tiles: p.tile_seq.len,
                tile_seq: p.tile_seq.on(words),
                tile_q0: p.tile_q0.on(words),
                seqs: m.seqs,
                cu_q: p.cu_q.on(words),
                q_pos0: p.q_pos0.on(words),
                k_row0: pass.k_row0.on(words),
                k_pos0: pass.k_pos0.on(words),
                k_len: pass.k_len.on(words),
                scale: self.scale,
                pass: PrefillPass { load_state: pass.load_state, last: pass.last },
            };
            k.attention.prefill(s, &a)?;
        }
        Ok(())
    }

    /// A SiLU MLP over `t` rows of `x` into `out`.
    fn mlp(&self, dev: &Device, w: &MlpWeights, x: DSlice<bf16>, t: usize, out: DSlice<bf16>) -> anyhow::Result<()> {
        let hidden = self.cfg.hidden_size;
        let inter = w.down.inp;
        let ws = &self.ws;
        let x = Strided::new(x, hidden);
        self.linears.linear(dev, &w.gate_up.proj(), x, t, rows(&ws.gate_up, 2 * inter))?;
        dev.k.elementwise.silu_mul(dev.stream(), ws.gate_up.slice(), ws.act.slice(), t, inter)?;
        self.linears.linear(dev, &w.down.proj(), rows(&ws.act, inter), t, Strided::new(out, hidden))?;
        Ok(())
    }

    /// DeepSeekMoE over `t` rows of `x` into `out`: routed experts plus the shared ones.
    fn moe(&self, dev: &Device, w: &MoeWeights, x: DSlice<bf16>, t: usize, out: DSlice<bf16>) -> anyhow::Result<()> {
        let (s, k) = (dev.stream(), &dev.k);
        let cfg = &self.cfg;
        let hidden = cfg.hidden_size;
        let ws = &self.ws;
        let mb = ws.moe.as_ref().expect("MoE buffers exist when a layer is MoE");
        let fp8 = w.gate_up.mats().is_fp8();
        // W8A8 where its scratch exists (FP8 experts on Hopper, `fp8_w8a8` on).
        let fp8_act = mb.fp8_act.as_ref().filter(|_| fp8);
        let tile =
            k.grouped_gemm.tile_for_mats(t, cfg.num_experts_per_tok, cfg.n_routed_experts, fp8, fp8_act.is_some());
        let r = mb.routing(t, cfg, tile);
        let (e, im) = (cfg.n_routed_experts, cfg.moe_intermediate_size);
        let route = |logits: DSlice<f32>| k.moe.route(s, logits, w.bias.as_ref().map(|b| b.slice()), &r, &self.route);
        if moe_small::takes(cfg, w, t) {
            let io = MoeSmallIo {
                tokens: t,
                x,
                router_logits: mb.router_logits.slice(),
                routing: &r,
                act: mb.grouped_act.slice(),
                act_shared: mb.grouped_gate_up.slice(),
                out,
            };
            moe_small::router(dev, cfg, w, &io)?;
            route(mb.router_logits.slice())?;
            return moe_small::experts(dev, cfg, w, &io);
        }
        k.elementwise.bf16_to_f32(s, x.sub(0, t * hidden), mb.h_f32.slice(), t * hidden)?;
        dev.blas.linear_f32(w.router.slice(), e, hidden, mb.h_f32.slice(), t, mb.router_logits.slice())?;
        route(mb.router_logits.slice())?;
        k.moe.align(s, &r)?;
        let rows = r.rows();
        // The expert inputs, grouped by expert: gathered in bf16, or gathered and quantized in
        // one pass for W8A8 (whose tile map `tile_for_mats` made the wgmma one).
        let (gate_up_in, down_in) = match fp8_act {
            Some(q) => {
                k.fp8_convert.quantize_act_gather(s, Strided::new(x, hidden), r.perm_src, rows, hidden, &q.x())?;
                (GroupedInput::Fp8(q.x()), GroupedInput::Fp8(q.act()))
            }
            None => {
                k.elementwise.gather_rows(s, x, r.perm_src, mb.grouped_x.slice(), rows, hidden)?;
                (mb.grouped_x.slice().into(), mb.grouped_act.slice().into())
            }
        };
        let gate_up = GroupedGateUp {
            a: gate_up_in,
            w: w.gate_up.mats(),
            gate_up: mb.grouped_gate_up.slice(),
            act: mb.grouped_act.slice(),
            inter: im,
            k: hidden,
        };
        k.grouped_gemm.gate_up_act(s, &gate_up, &r)?;
        if let Some(q) = fp8_act {
            k.fp8_convert.quantize_act(s, Strided::new(mb.grouped_act.slice(), im), rows, im, &q.act())?;
        }
        let down = GroupedGemm { a: down_in, w: w.down.mats(), c: mb.grouped_y.slice(), n: hidden, k: im };
        k.grouped_gemm.gemm(s, &down, &r)?;
        let shared = match &w.shared {
            Some(sh) => {
                self.mlp(dev, sh, x, t, mb.shared_out.slice())?;
                Some(mb.shared_out.slice())
            }
            None => None,
        };
        k.moe.combine(s, mb.grouped_y.slice(), &r, shared, out, hidden)?;
        Ok(())
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
        let (toks, lps) = (self.host_tokens.as_slice(), self.host_logprobs.as_slice());
        let (tids, tlps) = (self.host_top_ids.as_slice(), self.host_top_lps.as_slice());
        let seqs = m
            .outputs
            .iter()
            .map(|o| SeqResult {
                seq_id: o.seq_id,
                logits: o.logit_rows.iter().map(|&r| logits[r * v..(r + 1) * v].to_vec()).collect(),
                sampled: o.sample_row.map(|r| SampledToken {
                    token: toks[r] as u32,
                    logprob: if o.top_logprobs.is_some() { lps[r] } else { 0.0 },
                    top_logprobs: (0..o.top_logprobs.unwrap_or(0))
                        .map(|j| (tids[r * MAX_TOP_LOGPROBS + j] as u32, tlps[r * MAX_TOP_LOGPROBS + j]))
                        .collect(),
                }),
            })
            .collect();
        Ok(StepOutput { seqs })
    }
}
