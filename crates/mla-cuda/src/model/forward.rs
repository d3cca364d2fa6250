//! One forward step: embedding, the decoder layers (MLA attention on the normal path for prefill
//! and the absorbed path for decode, dense MLP or DeepSeekMoE), the final norm, the output
//! projection for the rows that need logits, and device sampling.
//!
//! `queue_forward` only queues work on the stream: no allocation, no synchronisation, no host
//! reads of device data, so a decode step can be captured as a CUDA graph as is.

use super::meta::{MetaLimits, StepMeta};
use super::moe_small::{MoeSmall, MoeSmallIo};
use super::weights::{DeviceWeights, FfnWeights, MlpWeights, MoeWeights, QueryWeights};
use super::workspace::{Limits, Workspace};
use crate::device::Device;
use crate::gpu::{DSlice, DeviceBuffer, PinnedBuffer};
use crate::ops::{
    AbsorbQ, DecodeAttention, PrefillAttention, PrefillPass, RopeCache, RouteMethod, SampleParamsRaw, SamplerOutputs,
    COMBINE_ABSORB_MAX_BATCH, LATENT, MAX_TOP_LOGPROBS, NOPE, PAGE_SIZE, ROPE, V_HEAD,
};
use half::bf16;
use mla_core::config::TopkMethod;
use mla_core::plan::{SampledToken, SeqResult, StepKind, StepOutput, StepPlan};
use mla_core::ModelConfig;

#[derive(Debug, Clone)]
pub struct ModelOptions {
    pub limits: Limits,
    /// Fraction of device memory for weights, activations and the KV cache together.
    pub gpu_memory_utilization: f64,
    /// Fixed cache size in blocks instead of sizing from memory (tests).
    pub num_blocks: Option<usize>,
    /// Longest sequence (prompt + output) the backend accepts.
    pub max_model_len: usize,
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
    meta_dev: DeviceBuffer<i32>,
    meta_host: PinnedBuffer<i32>,
    /// Bumped whenever the metadata buffer moves (a captured graph must then be re-captured).
    pub meta_generation: u64,
    host_tokens: PinnedBuffer<i32>,
    host_logprobs: PinnedBuffer<f32>,
    host_top_ids: PinnedBuffer<i32>,
    host_top_lps: PinnedBuffer<f32>,
    pub lim: MetaLimits,
    pub max_model_len: usize,
    scale: f32,
    attn_factor: f32,
    eps: f32,
    /// Bytes measured for the activation workspace (cuMemGetInfo before/after allocating it).
    pub activation_bytes: usize,
    /// Forces the decode split count (tests comparing eager steps with a captured graph).
    pub decode_splits_override: Option<usize>,
    /// Linear layers of steps with at most 4 rows (decode at small batch).
    pub gemv: super::gemv::Gemv,
    /// MoE layers of steps with at most `MOE_GEMV_MAX_TOKENS` tokens.
    pub moe_small: MoeSmall,
}

fn meta_len(l: &Limits, max_blocks_per_seq: usize) -> usize {
    // tokens/positions/slots, prefill tables and passes, decode block tables, sampling params.
    8 * l.max_tokens
        + 16 * l.max_seqs
        + l.max_seqs * max_blocks_per_seq
        + 4 * l.max_kv_chunk
        + 2 * l.max_logit_rows
        + 64
}

impl CudaModel {
    pub fn new(dev: &Device, cfg: ModelConfig, weights: DeviceWeights, opts: &ModelOptions) -> anyhow::Result<Self> {
        super::check_supported(&cfg)?;
        dev.gpu.sync()?;
        let max_model_len = opts.max_model_len.min(cfg.max_position_embeddings).max(1);
        let max_blocks_per_seq = max_model_len.div_ceil(PAGE_SIZE);
        let (free0, total) = dev.gpu.mem_info()?;
        let ws = Workspace::new(&cfg, opts.limits, dev.k.sm_count)?;
        let meta_words = meta_len(&opts.limits, max_blocks_per_seq);
        let meta_dev = DeviceBuffer::alloc(meta_words)?;
        let meta_host = PinnedBuffer::alloc(meta_words)?;
        let (free1, _) = dev.gpu.mem_info()?;
        let activation_bytes = free0.saturating_sub(free1);
        let row_bytes = cfg.num_hidden_layers * cfg.kv_cache_dim() * 2;
        let num_blocks = match opts.num_blocks {
            Some(n) => n,
            None => {
                // What the whole process may hold, minus what it holds now and a margin for
                // cuBLAS internals, graphs and the driver.
                let allowed = (opts.gpu_memory_utilization * total as f64) as usize;
                let used = total - free1;
                let margin = 512usize << 20;
                let budget = allowed.saturating_sub(used + margin);
                // One block less: the padding block comes on top.
                (budget / (row_bytes * PAGE_SIZE)).saturating_sub(1)
            }
        };
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        anyhow::ensure!(
            num_blocks > 0,
            "no memory left for the KV cache (gpu_memory_utilization {} of {:.1} GiB; weights {:.2} GiB, activations {:.2} GiB)",
            opts.gpu_memory_utilization,
            gib(total),
            gib(weights.bytes()),
            gib(activation_bytes)
        );
        let cache = DeviceBuffer::alloc((num_blocks + 1) * PAGE_SIZE * cfg.num_hidden_layers * cfg.kv_cache_dim())?;
        let inv_freq = DeviceBuffer::from_host(&cfg.rope_inv_freq())?;
        let s = opts.limits.max_seqs;
        let lim = MetaLimits {
            max_tokens: opts.limits.max_tokens,
            max_seqs: s,
            max_logit_rows: opts.limits.max_logit_rows,
            max_kv_chunk: opts.limits.max_kv_chunk,
            max_blocks_per_seq,
            vocab: cfg.vocab_size,
        };
        Ok(CudaModel {
            scale: cfg.softmax_scale() as f32,
            attn_factor: cfg.rope_attention_factor() as f32,
            eps: cfg.rms_norm_eps as f32,
            cfg,
            weights,
            ws,
            cache,
            num_blocks,
            inv_freq,
            meta_dev,
            meta_host,
            meta_generation: 0,
            host_tokens: PinnedBuffer::alloc(s)?,
            host_logprobs: PinnedBuffer::alloc(s)?,
            host_top_ids: PinnedBuffer::alloc(s * MAX_TOP_LOGPROBS)?,
            host_top_lps: PinnedBuffer::alloc(s * MAX_TOP_LOGPROBS)?,
            lim,
            max_model_len,
            activation_bytes,
            decode_splits_override: None,
            gemv: super::gemv::Gemv::load(dev, true)?,
            moe_small: MoeSmall::load(dev, true)?,
        })
    }

    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// The private block padding rows of a graph-replayed decode batch use.
    pub fn pad_block(&self) -> usize {
        self.num_blocks
    }

    fn layer_cache(&self, layer: usize) -> DSlice<bf16> {
        let per = (self.num_blocks + 1) * PAGE_SIZE * self.cfg.kv_cache_dim();
        self.cache.sub(layer * per, per)
    }

    /// Words the device metadata buffer holds now.
    pub fn meta_words(&self) -> usize {
        self.meta_dev.len()
    }

    fn meta(&self, off: usize, len: usize) -> DSlice<i32> {
        self.meta_dev.sub(off, len)
    }

    /// Runs one step: validate, upload metadata, queue the forward pass, read results.
    pub fn step(&mut self, dev: &Device, plan: &StepPlan) -> anyhow::Result<StepOutput> {
        plan.validate(PAGE_SIZE, self.num_blocks, self.cfg.vocab_size, self.max_model_len)?;
        if plan.seqs.is_empty() {
            return Ok(StepOutput::default());
        }
        let meta = StepMeta::build(plan, &self.lim)?;
        let run = |me: &mut Self| -> anyhow::Result<StepOutput> {
            me.upload_meta(dev, &meta)?;
            let splits = me.default_decode_splits(dev, &meta);
            me.queue_forward(dev, &meta, splits)?;
            me.read_outputs(dev, &meta)
        };
        let out = run(self);
        if out.is_err() {
            // Leave no copy or kernel of the failed step in flight.
            let _ = dev.gpu.sync();
        }
        out
    }

    pub fn default_decode_splits(&self, dev: &Device, meta: &StepMeta) -> usize {
        self.decode_splits_override
            .unwrap_or_else(|| dev.k.decode_splits(meta.seqs, self.cfg.num_attention_heads, meta.max_pages))
    }

    /// Decode splits a graph captured for `batch` sequences uses (valid for any context length).
    pub fn graph_decode_splits(&self, dev: &Device, batch: usize) -> usize {
        dev.k.decode_splits(batch, self.cfg.num_attention_heads, self.lim.max_blocks_per_seq)
    }

    /// Copies the step's metadata into the device buffer (growing it outside any capture). The
    /// previous step ended with a synchronisation, so the pinned staging buffer is free.
    pub fn upload_meta(&mut self, dev: &Device, meta: &StepMeta) -> anyhow::Result<()> {
        if meta.words.len() > self.meta_dev.len() {
            dev.gpu.sync()?;
            let n = meta.words.len().next_power_of_two();
            self.meta_dev = DeviceBuffer::alloc(n)?;
            self.meta_host = PinnedBuffer::alloc(n)?;
            self.meta_generation += 1;
        }
        let host = self.meta_host.as_mut_slice();
        host[..meta.words.len()].copy_from_slice(&meta.words);
        for &(a, b) in &meta.upload {
            self.meta_host.copy_to_device(a, b - a, self.meta_dev.sub(a, b - a), dev.stream())?;
        }
        Ok(())
    }

    /// Queues the whole forward pass and sampling for an uploaded step (graph-capturable).
    pub fn queue_forward(&self, dev: &Device, m: &StepMeta, decode_splits: usize) -> anyhow::Result<()> {
        let (s, k) = (dev.stream(), &dev.k);
        let cfg = &self.cfg;
        let (t, hidden) = (m.tokens, cfg.hidden_size);
        let ws = &self.ws;
        let eps = self.eps;
        k.embedding(
            s,
            self.weights.embed.buf.slice(),
            cfg.vocab_size,
            self.meta(m.tok, t),
            ws.residual.slice(),
            t,
            hidden,
        )?;
        for (l, lw) in self.weights.layers.iter().enumerate() {
            if l == 0 {
                k.rmsnorm_f32(s, ws.residual.slice(), lw.input_norm.slice(), ws.h.slice(), t, hidden, eps)?;
            } else {
                k.add_rmsnorm(
                    s,
                    ws.residual.slice(),
                    ws.ffn_out.slice(),
                    lw.input_norm.slice(),
                    ws.h.slice(),
                    t,
                    hidden,
                    eps,
                )?;
            }
            self.attention(dev, l, m, decode_splits)?;
            k.add_rmsnorm(
                s,
                ws.residual.slice(),
                ws.delta.slice(),
                lw.post_norm.slice(),
                ws.h.slice(),
                t,
                hidden,
                eps,
            )?;
            match &lw.ffn {
                FfnWeights::Dense(mlp) => self.mlp(dev, mlp, t, ws.ffn_out.slice())?,
                FfnWeights::Moe(moe) => self.moe(dev, moe, t)?,
            }
        }
        k.add_rmsnorm(
            s,
            ws.residual.slice(),
            ws.ffn_out.slice(),
            self.weights.norm.slice(),
            ws.h.slice(),
            t,
            hidden,
            eps,
        )?;
        if m.logit_rows > 0 {
            let r = m.logit_rows;
            k.gather_rows(s, ws.h.slice(), self.meta(m.logit_src, r), ws.h_rows.slice(), r, hidden)?;
            let v = cfg.vocab_size;
            self.gemv.linear_f32_out(
                dev,
                &self.weights.output_projection(),
                ws.h_rows.slice(),
                hidden,
                r,
                ws.logits.slice(),
                v,
            )?;
        }
        if m.sample_rows > 0 {
            let n = m.sample_rows;
            let params = self.meta(m.params, n * 12);
            // SAFETY: the params section holds `n` SampleParamsRaw (12 words each, 8-byte aligned).
            let params = unsafe { DSlice::<SampleParamsRaw>::from_raw(params.ptr, n) };
            let out = SamplerOutputs {
                token: ws.sampled_token.slice(),
                logprob: ws.sampled_logprob.slice(),
                top_ids: ws.top_ids.slice(),
                top_lps: ws.top_lps.slice(),
            };
            k.sample(
                s,
                ws.logits.slice(),
                cfg.vocab_size,
                n,
                cfg.vocab_size,
                params,
                self.meta_dev.tail(m.pen),
                ws.sample_work.slice(),
                &out,
            )?;
        }
        Ok(())
    }

    fn attention(&self, dev: &Device, l: usize, m: &StepMeta, decode_splits: usize) -> anyhow::Result<()> {
        let (s, k, blas) = (dev.stream(), &dev.k, &dev.blas);
        let cfg = &self.cfg;
        let ws = &self.ws;
        let lw = &self.weights.layers[l];
        let (t, hidden, heads) = (m.tokens, cfg.hidden_size, cfg.num_attention_heads);
        let (qd, lat) = (NOPE + ROPE, LATENT + ROPE);
        let h = ws.h.slice();
        // q (or q_a) and kv_a both read h: one launch at small batch.
        let kv_a = (&lw.kv_a.lin(), ws.kva.slice(), lat);
        match &lw.query {
            QueryWeights::Direct(q) => {
                self.gemv.linear_pair(dev, h, hidden, t, (&q.lin(), ws.q.slice(), heads * qd), kv_a)?
            }
            QueryWeights::LowRank { a, a_norm, b } => {
                let r = a.out;
                self.gemv.linear_pair(dev, h, hidden, t, (&a.lin(), ws.q_a.slice(), r), kv_a)?;
                k.rmsnorm_bf16(s, ws.q_a.slice(), r, a_norm.slice(), ws.q_a_normed.slice(), r, t, r, self.eps)?;
                self.gemv.linear(dev, &b.lin(), ws.q_a_normed.slice(), r, t, ws.q.slice(), heads * qd)?;
            }
        }
        let cache = self.layer_cache(l);
        let decode = m.kind == StepKind::Decode;
        let kv_b = lw.kv_b.lin();
        // Small decode steps absorb the queries in the rope/cache launch (latent_cache.cu).
        let absorb_in_rope = decode && t <= SMALL_DECODE_TOKENS;
        k.rope_cache(
            s,
            &RopeCache {
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
                positions: self.meta(m.pos, t),
                slots: self.meta(m.slot, t),
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
            },
        )?;
        if decode {
            if !absorb_in_rope {
                blas.absorb_q(&kv_b, heads, ws.q.slice(), t, ws.q_abs.slice())?;
            }
            let p = DecodeAttention {
                batch: t,
                heads,
                q: ws.q_abs.slice(),
                cache,
                block_tables: self.meta_dev.tail(m.block_tables),
                bt_stride: self.meta(m.bt_stride, 1),
                seq_lens: self.meta(m.seq_lens, t),
                num_splits: decode_splits,
                out: ws.o_lat.slice(),
                part_o: ws.part_o.slice(),
                part_lse: ws.part_lse.slice(),
                scale: self.scale,
            };
            if t <= COMBINE_ABSORB_MAX_BATCH {
                // Small steps: the split merge and W_UV in one launch after the partials.
                k.decode_attention_partials(s, &p)?;
                k.decode_combine_absorb_o(s, p.part_o, p.part_lse, heads, p.num_splits, t, &kv_b, ws.attn_out.slice())?;
            } else {
                k.decode_attention(s, &p)?;
                blas.absorb_o(&kv_b, heads, ws.o_lat.slice(), t, ws.attn_out.slice())?;
            }
        } else {
            let kvw = heads * (NOPE + V_HEAD);
            for p in &m.passes {
                k.gather_latent(s, cache, self.meta(p.slots, p.keys), ws.latent.slice(), p.keys, lat)?;
                blas.linear(&kv_b, ws.latent.slice(), lat, p.keys, ws.kv.slice(), kvw)?;
                k.prefill_attention(
                    s,
                    &PrefillAttention {
                        heads,
                        q_rows: t,
                        q: ws.q.slice(),
                        q_stride: heads * qd,
                        k_rows: p.keys,
                        kv: ws.kv.slice(),
                        kv_stride: kvw,
                        kpe: ws.latent.slice().tail(LATENT),
                        kpe_stride: lat,
                        out: ws.attn_out.slice(),
                        out_stride: heads * V_HEAD,
                        state_o: ws.state_o.slice(),
                        state_ml: ws.state_ml.slice(),
                        tiles: m.tiles,
                        tile_seq: self.meta(m.tile_seq, m.tiles),
                        tile_q0: self.meta(m.tile_q0, m.tiles),
                        seqs: m.seqs,
                        cu_q: self.meta(m.cu_q, m.seqs + 1),
                        q_pos0: self.meta(m.q_pos0, m.seqs),
                        k_row0: self.meta(p.k_row0, m.seqs),
                        k_pos0: self.meta(p.k_pos0, m.seqs),
                        k_len: self.meta(p.k_len, m.seqs),
                        scale: self.scale,
                        pass: PrefillPass { load_state: p.load_state, last: p.last },
                    },
                )?;
            }
        }
        self.gemv.linear(dev, &lw.o_proj.lin(), ws.attn_out.slice(), heads * V_HEAD, t, ws.delta.slice(), hidden)?;
        Ok(())
    }

    fn mlp(&self, dev: &Device, w: &MlpWeights, t: usize, out: DSlice<bf16>) -> anyhow::Result<()> {
        let hidden = self.cfg.hidden_size;
        let inter = w.down.inp;
        let ws = &self.ws;
        self.gemv.linear(dev, &w.gate_up.lin(), ws.h.slice(), hidden, t, ws.gate_up.slice(), 2 * inter)?;
        dev.k.silu_mul(dev.stream(), ws.gate_up.slice(), ws.act.slice(), t, inter)?;
        self.gemv.linear(dev, &w.down.lin(), ws.act.slice(), inter, t, out, hidden)?;
        Ok(())
    }

    fn moe(&self, dev: &Device, w: &MoeWeights, t: usize) -> anyhow::Result<()> {
        let (s, k) = (dev.stream(), &dev.k);
        let cfg = &self.cfg;
        let hidden = cfg.hidden_size;
        let ws = &self.ws;
        let mb = ws.moe.as_ref().expect("MoE buffers exist when a layer is MoE");
        let r = mb.routing(t, cfg, k.moe_tile_m(t, cfg.num_experts_per_tok, cfg.n_routed_experts));
        let (e, im) = (cfg.n_routed_experts, cfg.moe_intermediate_size);
        let method = match (cfg.topk_method, cfg.n_group) {
            (TopkMethod::Greedy, _) => RouteMethod::Greedy,
            (TopkMethod::GroupLimitedGreedy, _) => RouteMethod::GroupLimited,
            (TopkMethod::NoauxTc, _) => RouteMethod::NoauxTc,
        };
        let route = |logits: DSlice<f32>| {
            k.moe_route(
                s,
                logits,
                w.bias.as_ref().map(|b| b.slice()),
                &r,
                method,
                cfg.n_group,
                cfg.topk_group,
                cfg.norm_topk_prob,
                cfg.routed_scaling_factor as f32,
            )
        };
        if self.moe_small.takes(cfg, w, t) {
            let io = MoeSmallIo {
                tokens: t,
                x: ws.h.slice(),
                router_logits: mb.router_logits.slice(),
                routing: &r,
                act: mb.grouped_act.slice(),
                act_shared: mb.grouped_gate_up.slice(),
                out: ws.ffn_out.slice(),
            };
            self.moe_small.router(dev, cfg, w, &io)?;
            route(mb.router_logits.slice())?;
            return self.moe_small.experts(dev, cfg, w, &io);
        }
        k.bf16_to_f32(s, ws.h.slice(), mb.h_f32.slice(), t * hidden)?;
        dev.blas.linear_f32(w.router.slice(), e, hidden, mb.h_f32.slice(), t, mb.router_logits.slice())?;
        route(mb.router_logits.slice())?;
        k.moe_align(s, &r)?;
        k.moe_gather(s, ws.h.slice(), &r, mb.grouped_x.slice(), hidden)?;
        k.moe_gate_up_act(
            s,
            mb.grouped_x.slice(),
            w.gate_up.slice(),
            mb.grouped_gate_up.slice(),
            mb.grouped_act.slice(),
            im,
            hidden,
            &r,
        )?;
        k.moe_grouped_gemm(s, mb.grouped_act.slice(), w.down.slice(), mb.grouped_y.slice(), hidden, im, &r)?;
        let shared = match &w.shared {
            Some(sh) => {
                self.mlp(dev, sh, t, mb.shared_out.slice())?;
                Some(mb.shared_out.slice())
            }
            None => None,
        };
        k.moe_combine(s, mb.grouped_y.slice(), &r, shared, ws.ffn_out.slice(), hidden)?;
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
            crate::gpu::download_slice(self.ws.logits.sub(0, m.logit_rows * v))?
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
