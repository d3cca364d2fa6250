// The numbers the kernels and their Rust wrappers must agree on: MLA dimensions, the page size,
// tile shapes that decide grids and buffer sizes, and the dynamic shared memory of each kernel
// that asks for more than the default 48 KB. build.rs turns every `constexpr int NAME = EXPR;`
// line of this file into `pub const NAME: usize = EXPR;` in mla-cuda's `ops::dims`, so the Rust
// side never repeats one of them by hand.
//
// Rules, since both languages read this file: one definition per line; EXPR uses only integer
// literals, + - * / and parentheses, and names defined above it. Each kernel file checks with a
// static_assert that its own shared-memory layout ends exactly at the size given here.
#pragma once

// MLA dimensions of every published DeepSeek-V2/V3 model (the CUDA backend refuses others).
constexpr int LATENT = 512;                // kv_lora_rank: the compressed c_kv
constexpr int ROPE = 64;                   // qk_rope_head_dim: k_pe and q_pe
constexpr int NOPE = 128;                  // qk_nope_head_dim
constexpr int V_HEAD = 128;                // v_head_dim
constexpr int LATENT_ROW = LATENT + ROPE;  // one cached token of one layer: [c_kv ; k_pe]

// Tokens per block of the paged latent cache (FlashMLA's page size).
constexpr int PAGE_SIZE = 64;

// The FP8 latent cache (`--kv-cache-dtype fp8`, mla_core::model::latent_fp8): a row is the 576
// e4m3 codes, then one 16-byte block with the power-of-two scale exponents of the groups of 64
// columns (9 bytes) and zero padding: 592 bytes against 1,152 in bf16.
constexpr int LATENT_FP8_GROUP = 64;
constexpr int LATENT_FP8_ROW_BYTES = LATENT_ROW + 16;

// Threads of the query absorption fused into the rope/cache launch: one per latent column.
constexpr int ROPE_ABSORB_THREADS = LATENT;

// Decode attention: heads per block (one MMA tile of rows) and the dynamic shared memory of the
// four- and eight-warp kernels: Q tile + two KV pages + P tile (bf16, rows padded by 8), the
// per-warp row max/sum, and the partial-S exchange (4 warps x 8 or 8 warps x 2 key tiles of 32
// lanes x 16 bytes).
constexpr int DECODE_HEAD_TILE = 16;
constexpr int DECODE_SMEM_BYTES_4W =
    (DECODE_HEAD_TILE * (LATENT_ROW + 8) + 2 * PAGE_SIZE * (LATENT_ROW + 8) + DECODE_HEAD_TILE * (PAGE_SIZE + 8)) * 2 +
    2 * 4 * DECODE_HEAD_TILE * 4 + 4 * 8 * 32 * 16;
constexpr int DECODE_SMEM_BYTES_8W =
    (DECODE_HEAD_TILE * (LATENT_ROW + 8) + 2 * PAGE_SIZE * (LATENT_ROW + 8) + DECODE_HEAD_TILE * (PAGE_SIZE + 8)) * 2 +
    2 * 8 * DECODE_HEAD_TILE * 4 + 8 * 2 * 32 * 16;
// The FP8-cache variants add two staging pages of raw FP8 rows and keep one bf16 page (the
// dequantized copy the MMAs read) instead of two.
constexpr int DECODE_SMEM_BYTES_FP8_4W =
    DECODE_SMEM_BYTES_4W - PAGE_SIZE * (LATENT_ROW + 8) * 2 + 2 * PAGE_SIZE * LATENT_FP8_ROW_BYTES;
constexpr int DECODE_SMEM_BYTES_FP8_8W =
    DECODE_SMEM_BYTES_8W - PAGE_SIZE * (LATENT_ROW + 8) * 2 + 2 * PAGE_SIZE * LATENT_FP8_ROW_BYTES;
// The fused split merge + W_UV absorption of small decode steps: most tokens, output dims per block.
constexpr int COMBINE_ABSORB_MAX_BATCH = 4;
constexpr int COMBINE_ABSORB_DIMS = 32;

// Prefill attention: query rows per tile-map entry (one wgmma block, two mma.sync blocks), and the
// dynamic shared memory of the mma.sync kernel (Q [64 x 200] + 2 x K [64 x 200] + 2 x V [64 x 136]
// bf16) and of the wgmma kernel (Q [128 x 192] + 2 x (K [128 x 192] + V [128 x 128]) bf16, plus
// 1024 bytes of alignment slack and 1024 for the mbarriers).
constexpr int PREFILL_TILE_Q = 128;
constexpr int PREFILL_SMEM_BYTES = (64 * (NOPE + ROPE + 8) + 2 * 64 * (NOPE + ROPE + 8) + 2 * 64 * (V_HEAD + 8)) * 2;
constexpr int PREFILL_SM90_SMEM_BYTES = (128 * (NOPE + ROPE) + 2 * (128 * (NOPE + ROPE) + 128 * V_HEAD)) * 2 + 2048;

// Grouped expert GEMMs: rows per tile of the mma.sync kernels (prefill-sized and decode-sized)
// and of the wgmma kernels, the wgmma kernels' threads (a producer warpgroup and two consumer
// warpgroups) and dynamic shared memory: 4 stages of A [128 x 64] + W [256 x 64] bf16 (6 stages
// of W [128 x 64] for 128-row items: the same bytes), 1024 bytes of alignment slack, 128 for the
// full/empty mbarriers of the ring.
constexpr int GROUPED_TILE_M = 64;
constexpr int GROUPED_TILE_M_SMALL = 16;
constexpr int GROUPED_TILE_M_SM90 = 128;
constexpr int GROUPED_SM90_THREADS = 384;
constexpr int GROUPED_SM90_SMEM_BYTES = 4 * (128 + 256) * 64 * 2 + 1024 + 128;
// The block-FP8 wgmma kernels add a ring of 2 raw e4m3 weight slices [256 x 64] after the
// mbarriers, staged by cp.async before their dequantization into the bf16 stages.
constexpr int GROUPED_SM90_FP8_SMEM_BYTES = GROUPED_SM90_SMEM_BYTES + 2 * 256 * 64;

// Weight-streaming GEMV of small steps: most rows one launch can take, weight rows per block; the
// FP8 GEMV on tensor cores takes up to 8 rows (the MMA's token dimension).
constexpr int GEMV_KERNEL_MAX_ROWS = 4;
constexpr int GEMV_ROWS_PER_BLOCK = 8;
constexpr int FP8_GEMV_MAX_ROWS = 8;
// The streaming FP8 GEMV (gemv_fp8_stream_w<WARPS>t<TILES>s<STAGES>): per warp, STAGES ring slots
// of a lane's 16-byte chunks (4 per 16-row tile of weights, 4 of inputs) and the tile scales,
// then the split-K partial sums (TILES x 4 floats a lane); its dynamic shared memory per variant.
constexpr int GEMV_FP8_STREAM_STAGE_T1 = (4 + 4) * 32 * 16 + 32 * 4;
constexpr int GEMV_FP8_STREAM_STAGE_T2 = (4 * 2 + 4) * 32 * 16 + 2 * 32 * 4;
constexpr int GEMV_FP8_STREAM_SMEM_W4T1S4 = 4 * (4 * GEMV_FP8_STREAM_STAGE_T1 + 4 * 32 * 4);
constexpr int GEMV_FP8_STREAM_SMEM_W4T2S4 = 4 * (4 * GEMV_FP8_STREAM_STAGE_T2 + 2 * 4 * 32 * 4);
constexpr int GEMV_FP8_STREAM_SMEM_W8T1S6 = 8 * (6 * GEMV_FP8_STREAM_STAGE_T1 + 4 * 32 * 4);
constexpr int GEMV_FP8_STREAM_SMEM_W2T1S8 = 2 * (8 * GEMV_FP8_STREAM_STAGE_T1 + 4 * 32 * 4);
constexpr int GEMV_FP8_STREAM_SMEM_W4T1S6 = 4 * (6 * GEMV_FP8_STREAM_STAGE_T1 + 4 * 32 * 4);
constexpr int GEMV_FP8_STREAM_SMEM_W8T2S3 = 8 * (3 * GEMV_FP8_STREAM_STAGE_T2 + 2 * 4 * 32 * 4);

// Router top-k (moe.cu): most experts one lane holds. A run of 32 / n_group lanes holds a group,
// so 16 covers every n_group <= 32 dividing at most 256 experts (the worst, 255 in 17 groups,
// needs 15).
constexpr int MOE_ROUTE_MAX_SLOTS = 16;

// Small-step MoE GEMVs: warps per block of the router and gate/up kernels.
constexpr int MOE_GEMV_WARPS = 4;
// The streaming FP8 gate/up (moe_gate_up_stream.cu): warps per CTA, ring stages per warp, and
// its dynamic shared memory (per warp: stages of 8 chunks x 32 lanes x 16 bytes and two scales
// per lane, then 4 partial sums per lane).
constexpr int MOE_GATE_UP_STREAM_WARPS = 4;
constexpr int MOE_GATE_UP_STREAM_STAGES = 4;
constexpr int MOE_GATE_UP_STREAM_SMEM =
    MOE_GATE_UP_STREAM_WARPS * (MOE_GATE_UP_STREAM_STAGES * (8 * 32 * 16 + 2 * 32 * 4) + 4 * 32 * 4);

// Device sampler: most alternatives a row reports with its log-probability.
constexpr int MAX_TOP_LOGPROBS = 20;
// Threads of the block that samples a row, and of the one that recomputes a row's kept set for
// a speculative verdict: one number, since the kept set's sums depend on the block's shape and
// the verdict must find the set the sampler drew from. A row's passes are bound by instruction
// issue on their one SM: 1,024 threads took a B=1 top-p step from 2.294 to 2.061 ms (run S20).
constexpr int SAMPLER_THREADS = 1024;

// Speculative decoding: the most drafts a sequence feeds one verify step (mla-serve refuses more).
constexpr int MAX_SPEC_DRAFTS = 8;
