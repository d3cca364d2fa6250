//! Activation buffers, allocated once for the largest step the backend accepts, so a step never
//! allocates (a requirement for CUDA-graph capture) and memory use is known before the KV cache
//! is sized.

use super::draft_store::DraftStore;
use crate::gpu::DeviceBuffer;
use crate::ops::{Fp8Act, MoeRouting, TileM, FP8_BLOCK, MAX_TOP_LOGPROBS};
use half::bf16;
use mla_core::{ModelConfig, StepLimits};

/// The largest step the workspace is sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Tokens fed in one step (a prefill chunk, or one per sequence in decode).
    pub max_tokens: usize,
    /// Sequences in one step.
    pub max_seqs: usize,
    /// Rows of logits one step may produce (one per sampled sequence plus the rows asked for).
    pub max_logit_rows: usize,
    /// Cached keys decompressed per prefill pass; longer contexts take several passes.
    pub max_kv_chunk: usize,
    /// Rows the FFN (and so every projection) runs over: every rank's rows under DP attention.
    pub ffn_rows: usize,
}

impl Limits {
    /// The limits of a rank sized for `step_limits` (`mla_core::StepLimits`), decompressing at most
    /// `max_kv_chunk` cached keys per prefill pass (at least a step's tokens).
    pub fn of(step_limits: &StepLimits, max_kv_chunk: usize) -> Self {
        Limits {
            max_tokens: step_limits.rank_tokens,
            max_seqs: step_limits.rank_seqs,
            max_logit_rows: step_limits.rank_logit_rows,
            max_kv_chunk: max_kv_chunk.max(step_limits.rank_tokens),
            ffn_rows: step_limits.ffn_rows(),
        }
    }

    /// The limits with room for speculative decoding's verify steps, whose sequences each run
    /// `1 + drafts` decode rows (`model::speculative`): the engine budgets those rows as tokens,
    /// so the rows stay within `max_tokens`.
    pub fn with_draft_rows(self, drafts: usize) -> Self {
        let rows = (self.max_seqs * (1 + drafts)).min(self.max_tokens).max(self.max_seqs);
        Limits { max_seqs: rows, max_logit_rows: self.max_logit_rows + (rows - self.max_seqs), ..self }
    }

    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.max_tokens > 0 && self.max_seqs > 0, "limits must be positive: {self:?}");
        anyhow::ensure!(
            self.max_seqs <= self.max_tokens,
            "max_seqs {} exceeds max_tokens {}",
            self.max_seqs,
            self.max_tokens
        );
        anyhow::ensure!(
            self.max_logit_rows >= self.max_seqs,
            "max_logit_rows {} below max_seqs {}",
            self.max_logit_rows,
            self.max_seqs
        );
        anyhow::ensure!(
            self.max_kv_chunk >= self.max_tokens,
            "max_kv_chunk {} below max_tokens {}",
            self.max_kv_chunk,
            self.max_tokens
        );
        anyhow::ensure!(
            self.ffn_rows >= self.max_tokens,
            "ffn_rows {} below max_tokens {}",
            self.ffn_rows,
            self.max_tokens
        );
        Ok(())
    }
}

pub struct MoeBuffers {
    pub h_f32: DeviceBuffer<f32>,
    pub router_logits: DeviceBuffer<f32>,
    pub topk_ids: DeviceBuffer<i32>,
    pub topk_w: DeviceBuffer<f32>,
    pub expert_off: DeviceBuffer<i32>,
    pub perm_src: DeviceBuffer<i32>,
    pub inv_row: DeviceBuffer<i32>,
    pub tile_expert: DeviceBuffer<i32>,
    pub tile_row0: DeviceBuffer<i32>,
    pub tile_rows: DeviceBuffer<i32>,
    pub num_tiles: DeviceBuffer<i32>,
    pub grouped_x: DeviceBuffer<bf16>,
    pub grouped_gate_up: DeviceBuffer<bf16>,
    pub grouped_act: DeviceBuffer<bf16>,
    pub grouped_y: DeviceBuffer<bf16>,
    pub shared_out: DeviceBuffer<bf16>,
    /// W8A8 expert GEMMs (FP8 experts on Hopper): the grouped inputs and activations quantized.
    pub fp8_act: Option<MoeFp8Act>,
}

/// The quantized operands of W8A8 expert GEMMs: e4m3 rows and their per-128-column scales
/// (`[groups, rows]`), for the gate/up input `[rows, hidden]` and the activations `[rows, inter]`.
pub struct MoeFp8Act {
    pub x_q: DeviceBuffer<u8>,
    pub x_scales: DeviceBuffer<f32>,
    pub act_q: DeviceBuffer<u8>,
    pub act_scales: DeviceBuffer<f32>,
    pub rows: usize,
}

impl MoeFp8Act {
    fn alloc(rows: usize, hidden: usize, inter: usize) -> anyhow::Result<Self> {
        Ok(MoeFp8Act {
            x_q: DeviceBuffer::alloc(rows * hidden)?,
            x_scales: DeviceBuffer::alloc(hidden.div_ceil(FP8_BLOCK) * rows)?,
            act_q: DeviceBuffer::alloc(rows * inter)?,
            act_scales: DeviceBuffer::alloc(inter.div_ceil(FP8_BLOCK) * rows)?,
            rows,
        })
    }

    /// The quantized gate/up input: every routed row, grouped by expert.
    pub fn gate_up_input(&self) -> Fp8Act<'_> {
        Fp8Act { q: self.x_q.slice(), scales: self.x_scales.slice(), scale_ld: self.rows }
    }

    /// The quantized SiLU·mul activations, the down projection's input.
    pub fn down_input(&self) -> Fp8Act<'_> {
        Fp8Act { q: self.act_q.slice(), scales: self.act_scales.slice(), scale_ld: self.rows }
    }
}

impl MoeBuffers {
    /// The routing of `tokens` tokens with grouped-GEMM tiles of `tile` rows
    /// (`GroupedGemmKernels::tile_for`).
    pub fn routing(&self, tokens: usize, cfg: &ModelConfig, tile: TileM) -> MoeRouting<'_> {
        MoeRouting {
            tokens,
            tile,
            experts: cfg.n_routed_experts,
            top_k: cfg.num_experts_per_tok,
            topk_ids: self.topk_ids.slice(),
            topk_w: self.topk_w.slice(),
            expert_off: self.expert_off.slice(),
            perm_src: self.perm_src.slice(),
            inv_row: self.inv_row.slice(),
            tile_expert: self.tile_expert.slice(),
            tile_row0: self.tile_row0.slice(),
            tile_rows: self.tile_rows.slice(),
            num_tiles: self.num_tiles.slice(),
        }
    }
}

pub struct Workspace {
    pub limits: Limits,
    pub residual: DeviceBuffer<f32>,
    pub h: DeviceBuffer<bf16>,
    pub delta: DeviceBuffer<bf16>,
    pub ffn_out: DeviceBuffer<bf16>,
    pub q: DeviceBuffer<bf16>,
    pub q_a: DeviceBuffer<bf16>,
    pub q_a_normed: DeviceBuffer<bf16>,
    pub kva: DeviceBuffer<bf16>,
    pub attn_out: DeviceBuffer<bf16>,
    // Prefill (normal path).
    pub latent: DeviceBuffer<bf16>,
    pub kv: DeviceBuffer<bf16>,
    pub state_o: DeviceBuffer<f32>,
    pub state_ml: DeviceBuffer<f32>,
    // Decode (absorbed path).
    pub q_abs: DeviceBuffer<bf16>,
    pub o_lat: DeviceBuffer<bf16>,
    pub part_o: DeviceBuffer<f32>,
    pub part_lse: DeviceBuffer<f32>,
    // MLPs.
    pub gate_up: DeviceBuffer<bf16>,
    pub act: DeviceBuffer<bf16>,
    pub moe: Option<MoeBuffers>,
    // Output head and sampling.
    pub h_rows: DeviceBuffer<bf16>,
    pub logits: DeviceBuffer<f32>,
    pub sample_work: DeviceBuffer<f32>,
    pub sampled_token: DeviceBuffer<i32>,
    pub sampled_logprob: DeviceBuffer<f32>,
    pub top_ids: DeviceBuffer<i32>,
    pub top_lps: DeviceBuffer<f32>,
    /// The scores of scored rows (prompt logprobs), an entry per logits row at most.
    pub score_logprob: DeviceBuffer<f32>,
    pub score_rank: DeviceBuffer<i32>,
    pub score_top_ids: DeviceBuffer<i32>,
    pub score_top_lps: DeviceBuffer<f32>,
    /// Rows of split-KV partial outputs the decode kernel may use (batch x splits).
    pub split_rows: usize,
    /// Speculative decoding's MTP passes, when on.
    pub mtp: Option<MtpBuffers>,
}

/// What an MTP pass keeps besides the step's buffers (`model::speculative`).
pub struct MtpBuffers {
    /// The hidden rows the pass drafts from, in f32: the target's last hidden states (converted
    /// from bf16), or a previous MTP pass's output rows.
    pub prev: DeviceBuffer<f32>,
    /// Which rows of the source each MTP row takes.
    pub src: DeviceBuffer<i32>,
    /// The rows sampled drafts were drawn from, until they are verified.
    pub drafts: DraftStore,
}

impl Workspace {
    /// `fp8_expert_acts`: the experts run W8A8 (allocates their quantized operands).
    /// `mtp_drafts`: drafts per step of speculative decoding (0: off); with some, the MTP
    /// module's pass runs too (its layer is shaped as layer `num_hidden_layers`).
    pub fn new(
        cfg: &ModelConfig,
        limits: Limits,
        sm_count: usize,
        fp8_expert_acts: bool,
        mtp_drafts: usize,
    ) -> anyhow::Result<Self> {
        let mtp = mtp_drafts > 0;
        limits.check()?;
        let (t, s, h) = (limits.max_tokens, limits.max_seqs, cfg.hidden_size);
        // The FFN's buffers hold every rank's rows under DP attention.
        let f = limits.ffn_rows;
        let heads = cfg.num_attention_heads;
        let qd = cfg.q_head_dim();
        let lat = cfg.kv_cache_dim();
        let kvw = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim);
        let layers = cfg.num_hidden_layers + usize::from(mtp);
        let dense_inter =
            (0..layers).filter(|&i| !cfg.is_moe_layer(i)).map(|_| cfg.intermediate_size).max().unwrap_or(0);
        let inter = dense_inter.max(cfg.shared_expert_intermediate_size());
        let split_rows = sm_count + s;
        let moe = if cfg.n_routed_experts > 0 && (0..layers).any(|i| cfg.is_moe_layer(i)) {
            let (e, k, im) = (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size);
            let a = f * k;
            // The small tile height needs the most tiles.
            let tiles = MoeRouting::max_tiles(a, e, TileM::Rows16);
            Some(MoeBuffers {
                h_f32: DeviceBuffer::alloc(f * h)?,
                router_logits: DeviceBuffer::alloc(f * e)?,
                topk_ids: DeviceBuffer::alloc(a)?,
                topk_w: DeviceBuffer::alloc(a)?,
                expert_off: DeviceBuffer::alloc(e + 1)?,
                perm_src: DeviceBuffer::alloc(a)?,
                inv_row: DeviceBuffer::alloc(a)?,
                tile_expert: DeviceBuffer::alloc(tiles)?,
                tile_row0: DeviceBuffer::alloc(tiles)?,
                tile_rows: DeviceBuffer::alloc(tiles)?,
                num_tiles: DeviceBuffer::alloc(1)?,
                grouped_x: DeviceBuffer::alloc(a * h)?,
                grouped_gate_up: DeviceBuffer::alloc(a * 2 * im)?,
                grouped_act: DeviceBuffer::alloc(a * im)?,
                grouped_y: DeviceBuffer::alloc(a * h)?,
                shared_out: DeviceBuffer::alloc(f * h)?,
                fp8_act: if fp8_expert_acts { Some(MoeFp8Act::alloc(a, h, im)?) } else { None },
            })
        } else {
            None
        };
        let r = limits.max_logit_rows;
        Ok(Workspace {
            limits,
            residual: DeviceBuffer::alloc(t * h)?,
            // Zeroed: under DP attention a rank sends rows past its own (padding up to the
            // step's largest rank) to the FFN, and those must be finite numbers from the start.
            h: DeviceBuffer::alloc_zeroed(t * h)?,
            delta: DeviceBuffer::alloc(t * h)?,
            ffn_out: DeviceBuffer::alloc(t * h)?,
            q: DeviceBuffer::alloc(t * heads * qd)?,
            q_a: DeviceBuffer::alloc(t * cfg.q_lora_rank.unwrap_or(0))?,
            q_a_normed: DeviceBuffer::alloc(t * cfg.q_lora_rank.unwrap_or(0))?,
            kva: DeviceBuffer::alloc(t * lat)?,
            attn_out: DeviceBuffer::alloc(t * heads * cfg.v_head_dim)?,
            latent: DeviceBuffer::alloc(limits.max_kv_chunk * lat)?,
            kv: DeviceBuffer::alloc(limits.max_kv_chunk * kvw)?,
            state_o: DeviceBuffer::alloc(t * heads * cfg.v_head_dim)?,
            state_ml: DeviceBuffer::alloc(t * heads * 2)?,
            q_abs: DeviceBuffer::alloc(s * heads * lat)?,
            o_lat: DeviceBuffer::alloc(s * heads * cfg.kv_lora_rank)?,
            part_o: DeviceBuffer::alloc(split_rows * heads * cfg.kv_lora_rank)?,
            part_lse: DeviceBuffer::alloc(split_rows * heads)?,
            gate_up: DeviceBuffer::alloc(f * 2 * inter)?,
            act: DeviceBuffer::alloc(f * inter)?,
            moe,
            h_rows: DeviceBuffer::alloc(r * h)?,
            logits: DeviceBuffer::alloc(r * cfg.vocab_size)?,
            sample_work: DeviceBuffer::alloc(s * cfg.vocab_size)?,
            sampled_token: DeviceBuffer::alloc(s)?,
            sampled_logprob: DeviceBuffer::alloc(s)?,
            top_ids: DeviceBuffer::alloc(s * MAX_TOP_LOGPROBS)?,
            top_lps: DeviceBuffer::alloc(s * MAX_TOP_LOGPROBS)?,
            score_logprob: DeviceBuffer::alloc(r)?,
            score_rank: DeviceBuffer::alloc(r)?,
            score_top_ids: DeviceBuffer::alloc(r * MAX_TOP_LOGPROBS)?,
            score_top_lps: DeviceBuffer::alloc(r * MAX_TOP_LOGPROBS)?,
            split_rows,
            mtp: mtp
                .then(|| -> anyhow::Result<MtpBuffers> {
                    Ok(MtpBuffers {
                        prev: DeviceBuffer::alloc(t * h)?,
                        src: DeviceBuffer::alloc(t)?,
                        // Drafting sequences times their drafts stay within a verify step's rows.
                        drafts: DraftStore::new(s, mtp_drafts, cfg.vocab_size)?,
                    })
                })
                .transpose()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mla_core::StepBudget;

    #[test]
    fn a_dp_attention_rank_sizes_its_ffn_for_every_ranks_rows() {
        // The FP8 projections' scratch once held one rank's 2048 rows while the shared expert
        // ran over both ranks' 4096 (the engine died at the first concurrent prefills).
        let budget = StepBudget { max_num_batched_tokens: 2048, max_num_seqs: 256, max_extra_logit_rows: 512 };
        let (dpa, _) = StepLimits::derive(budget, 2).unwrap();
        let l = Limits::of(&dpa, 16384);
        assert_eq!((l.max_tokens, l.ffn_rows, l.max_seqs, l.max_logit_rows), (2048, 4096, 256, 768));
        l.check().unwrap();
        let (tp, _) = StepLimits::derive(budget, 1).unwrap();
        assert_eq!(Limits::of(&tp, 16384).ffn_rows, 2048);
        // Decompressing fewer keys per pass than a step feeds cannot work.
        assert_eq!(Limits::of(&dpa, 1024).max_kv_chunk, 2048);
    }
}
