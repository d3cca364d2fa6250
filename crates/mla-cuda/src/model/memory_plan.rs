//! How a rank's device memory is split between activations and the latent KV cache.
//!
//! The activations (workspace, FP8 projection scratch, step metadata) are sized for the largest
//! step the rank may run (`mla_core::StepLimits`), allocated after the weights, and the KV cache
//! takes what `--gpu-memory-utilization` leaves. When the token budget of the flags' default
//! leaves the cache below its goal (a model whose weights nearly fill the GPU, such as V2 236B
//! with DP attention on 80 GB cards, where every rank holds the whole attention and the FFN's
//! buffers hold every rank's rows), the budget is halved until the cache reaches the goal or the
//! budget its floor (`StepLimits::halved`): a smaller prefill chunk costs some prefill speed, no
//! cache costs the server. An explicit `--max-num-batched-tokens` is kept as given, and refused
//! only when it leaves no cache at all. The ranks of a group then take the smallest budget any of
//! them chose, so that every rank's gathered FFN step has the same shape, and the smallest cache.

use super::meta::MetaLimits;
use super::meta_buffers::MetaBuffers;
use super::parallel::{RankLink, RankMode};
use super::small_linear::SmallLinear;
use super::weights::Fp8Share;
use super::workspace::{Limits, Workspace};
use crate::device::Device;
use crate::ops::PAGE_SIZE;
use mla_core::{ModelConfig, StepLimits};

/// How the step's token budget meets the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetFit {
    /// The budget was given (`--max-num-batched-tokens`): kept as it is.
    Fixed,
    /// The default budget: halved while the cache stays below its goal.
    Shrink,
}

/// The cache the planner shrinks a default step budget for when `--max-model-len` is not
/// given: enough for long chats without giving up the prefill chunk on smaller models.
pub const DEFAULT_KV_GOAL_TOKENS: usize = 16384;

/// Everything a step reads or writes besides weights and cache, sized for `step_limits`.
pub struct Activations {
    pub ws: Workspace,
    pub linears: SmallLinear,
    pub meta: MetaBuffers,
    pub lim: MetaLimits,
    pub limits: Limits,
}

/// What the planner decided for one rank.
pub struct MemoryPlan {
    pub activations: Activations,
    /// The rank's mode with its collective buffers (sized for the limits chosen).
    pub mode: RankMode,
    /// The limits the activations are sized for (the asked ones, or smaller: see the module doc).
    pub step_limits: StepLimits,
    /// Bytes the activations took (cuMemGetInfo before and after allocating them).
    pub activation_bytes: usize,
    /// Blocks of the KV cache the block manager may use (equal on every rank of a group).
    pub num_blocks: usize,
}

/// What the planner needs besides the device and the model.
pub struct PlanInputs<'a> {
    /// The collective the rank joined: used to agree with the other ranks, then given its buffers.
    pub link: RankLink,
    pub cfg: &'a ModelConfig,
    pub fp8: &'a Fp8Share,
    /// The limits the flags ask for.
    pub step_limits: StepLimits,
    pub fit: BudgetFit,
    /// Tokens the cache should hold before a default budget is kept.
    pub kv_goal_tokens: usize,
    pub max_kv_chunk: usize,
    pub max_model_len: usize,
    pub gpu_memory_utilization: f64,
    /// A fixed cache size in blocks (tests, `--kv-cache-tokens`): no sizing from memory.
    pub num_blocks: Option<usize>,
    pub small_batch_gemv: bool,
    pub w8a8: bool,
    pub weight_bytes: usize,
    /// Bytes of one token's cached row in one layer (bf16 or FP8 rows).
    pub cache_row_bytes: usize,
    /// Speculative decoding's drafts per step (0: off): the MTP module's cache layer, its
    /// buffers and the verify steps' extra rows (`Limits::with_draft_rows`).
    pub mtp_drafts: usize,
}

impl PlanInputs<'_> {
    /// Layers of the KV cache: the model's, and the MTP module's when speculative decoding is on.
    pub fn cache_layers(&self) -> usize {
        self.cfg.num_hidden_layers + usize::from(self.mtp_drafts > 0)
    }
}

impl Activations {
    fn alloc(dev: &Device, p: &PlanInputs, step_limits: &StepLimits) -> anyhow::Result<Self> {
        // The window of cached keys decompressed per prefill pass shrinks with the budget (it
        // is 1 GiB at V2's 128 heads): more passes over a long context, the same work.
        let kv_chunk = p.max_kv_chunk * step_limits.rank_tokens / p.step_limits.rank_tokens;
        let limits = Limits::of(step_limits, kv_chunk).with_draft_rows(p.mtp_drafts);
        let lim = MetaLimits {
            max_tokens: limits.max_tokens,
            max_seqs: limits.max_seqs,
            max_logit_rows: limits.max_logit_rows,
            max_kv_chunk: limits.max_kv_chunk,
            max_blocks_per_seq: p.max_model_len.div_ceil(PAGE_SIZE),
            vocab: p.cfg.vocab_size,
        };
        // Every projection may see the FFN's rows (the shared expert and dense MLPs run over the
        // gathered rows under DP attention).
        let linears = SmallLinear::new(p.small_batch_gemv, p.fp8, limits.ffn_rows, p.w8a8)?;
        let w8a8_experts = p.w8a8 && p.fp8.expert_layers > 0 && dev.k.grouped_gemm.has_w8a8();
        let ws = Workspace::new(p.cfg, limits, dev.k.sm_count, w8a8_experts, p.mtp_drafts)?;
        let meta = MetaBuffers::new(&lim)?;
        Ok(Activations { ws, linears, meta, lim, limits })
    }
}

/// Sizes the activations and the KV cache of one rank (see the module doc). Every rank of a
/// group calls it once, at the same point: it issues the same two collectives on each.
pub fn plan(dev: &Device, p: PlanInputs) -> anyhow::Result<MemoryPlan> {
    let (free0, total) = dev.gpu.mem_info()?;
    // What the whole process may hold, minus a margin for cuBLAS internals, graphs and the
    // driver (and NCCL's buffers inside graphs).
    let allowed = (p.gpu_memory_utilization * total as f64) as usize;
    let margin = if p.link.comm().is_none() { 512usize << 20 } else { 1024usize << 20 };
    let row_bytes = p.cache_layers() * p.cache_row_bytes;
    let blocks_left = |free: usize| {
        let budget = allowed.saturating_sub(total - free + margin);
        // One block less: the padding block comes on top.
        (budget / (row_bytes * PAGE_SIZE)).saturating_sub(1)
    };
    let mut step_limits = p.step_limits;
    let mut act = loop {
        let tried = Activations::alloc(dev, &p, &step_limits);
        let (free1, _) = dev.gpu.mem_info()?;
        // The collectives' buffers come out of the same memory after this loop: a cache that
        // reached its goal only without them would fall short of it (V2 236B under DP
        // attention with the FP8 cache kept 2048-token steps for 13,568 KV tokens, run Q4).
        let collectives = tried.as_ref().map_or(0, |a| p.link.buffer_bytes(&a.limits, p.cfg.hidden_size));
        let blocks = p.num_blocks.unwrap_or_else(|| blocks_left(free1.saturating_sub(collectives)));
        let enough = p.num_blocks.is_some() || blocks * PAGE_SIZE >= p.kv_goal_tokens;
        let smaller = (p.fit == BudgetFit::Shrink && p.num_blocks.is_none()).then(|| step_limits.halved()).flatten();
        match (tried, smaller) {
            (Ok(act), Some(next)) if !enough => {
                tracing::info!(
                    "{} left room for {} KV tokens, fewer than the {} wanted; trying {} tokens per step",
                    step_limits.describe(),
                    blocks * PAGE_SIZE,
                    p.kv_goal_tokens,
                    next.rank_tokens
                );
                drop(act);
                step_limits = next;
            }
            (Ok(act), _) => break act,
            (Err(e), Some(next)) => {
                tracing::info!("{}: {e:#}; trying {} tokens per step", step_limits.describe(), next.rank_tokens);
                step_limits = next;
            }
            (Err(e), None) => {
                return Err(e.context(format!(
                    "allocating the activations for {} (weights {:.2} GiB; lower --max-num-batched-tokens or --max-num-seqs)",
                    step_limits.describe(),
                    gib(p.weight_bytes)
                )))
            }
        }
    };
    // The ranks gather each other's rows: they must all have the limits of the smallest
    // budget any of them chose (they started from the same limits and halve alike).
    let agreed = p.link.min_over_ranks(dev, step_limits.rank_tokens)?;
    if agreed < step_limits.rank_tokens {
        drop(act);
        while step_limits.rank_tokens > agreed {
            step_limits = step_limits.halved().expect("a peer halved this far from the same start");
        }
        act = Activations::alloc(dev, &p, &step_limits)?;
    }
    // The collectives' buffers come last; the cache is sized from what is left after them.
    let (hidden, goal) = (p.cfg.hidden_size, p.kv_goal_tokens);
    let (weight_bytes, utilization, fixed) = (p.weight_bytes, p.gpu_memory_utilization, p.num_blocks);
    let asked = p.step_limits;
    let mode = RankMode::new(p.link, &act.limits, hidden)?;
    let blocks = fixed.unwrap_or_else(|| dev.gpu.mem_info().map_or(0, |(f, _)| blocks_left(f)));
    let blocks = mode.min_over_ranks(dev, blocks)?;
    let (free1, _) = dev.gpu.mem_info()?;
    let activation_bytes = free0.saturating_sub(free1);
    anyhow::ensure!(
        blocks > 0,
        "no memory left for the KV cache (gpu_memory_utilization {utilization} of {:.1} GiB; weights {:.2} GiB, activations {:.2} GiB for {}); \
         lower --max-num-batched-tokens or --max-num-seqs, raise --gpu-memory-utilization, or spread the model over more GPUs",
        gib(total),
        gib(weight_bytes),
        gib(activation_bytes),
        step_limits.describe()
    );
    if step_limits != asked {
        tracing::warn!(
            "steps cut to {} tokens per rank (from {}) so that the KV cache holds {} tokens (goal {goal}): {}",
            step_limits.rank_tokens,
            asked.rank_tokens,
            blocks * PAGE_SIZE,
            step_limits.describe()
        );
    }
    Ok(MemoryPlan { activations: act, mode, step_limits, activation_bytes, num_blocks: blocks })
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}
