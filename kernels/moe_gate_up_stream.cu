// The small-step MoE's gate/up with SiLU·mul on block-FP8 experts (moe_gemv.cu's
// moe_gemv_gate_up_fp8, same inputs and outputs) as a streaming GEMV: gemv_fp8.cu's per-lane
// cp.async ring, exact e4m3 -> bf16 products on tensor cores and K split over a thread-block
// cluster, with the rows taken from the routed experts.
//
// Why: moe_gemv_gate_up_fp8 gives a warp one (slot, column) item at a time, two rows in two
// round trips after a dependent read of the expert id, and read a TP-8 rank of V3's 33 MB at
// 1.8 TB/s (18.6 us under ncu, run S34) where the dense streaming kernel reaches 3.6-3.75.
// Measured, this kernel wins only where its grid puts 2 CTAs on every SM and K is long (4 tokens
// on a TP-8 rank of V3: 108 MB at 2.56 TB/s); at 1-3 tokens and on V2-Lite's 2048-wide rows the
// warp kernel stays ahead (runs S40-S44), so `StreamPolicy` in ops/moe_gemv.rs chooses per step.
//
// A warp's MMA tile is 8 columns j0..j0+7 of one expert: its rows 0-7 are the gate rows j0 + g
// and rows 8-15 the up rows I + j0 + g, so lane (g, t) ends with gate and up of column j0 + g for
// tokens 2t and 2t + 1 in its own accumulators and applies SiLU·mul there. A CTA of WARPS warps
// covers 8 WARPS columns; grid.y walks the routed slots' column ranges (slot-major), then the
// shared experts'; grid.x is the K split (cluster rank). A routed CTA multiplies one token
// (slot / top_k), the shared experts' CTAs all `tokens` (MMA columns 0..tokens-1).
//
// Rounding as moe_gemv.cu: gate and up rounded to bf16, silu(gate) rounded, the product rounded.
// Their f32 sums are in another order than the warp kernel's, so a bf16 result may differ by one
// unit where a sum sits on a rounding boundary.
#include "fp8_stream.cuh"

namespace {
constexpr int WARPS = MOE_GATE_UP_STREAM_WARPS, STAGES = MOE_GATE_UP_STREAM_STAGES;
constexpr int COLS = 8;                  // intermediate columns per warp
constexpr int W_CHUNKS = 4;              // weight chunks per lane and stage: 2 halves x (gate, up)
constexpr int CHUNKS = W_CHUNKS + 4;     // and 4 of inputs (two 64-wide halves, 32 bytes each)
constexpr int SCALES_AT = CHUNKS * 512;  // then the gate and up scales, 32 lanes each
constexpr int STAGE_BYTES = SCALES_AT + 2 * 32 * 4;
static_assert(WARPS * (STAGES * STAGE_BYTES + 4 * 32 * 4) == MOE_GATE_UP_STREAM_SMEM,
              "dims.cuh's shared memory of the streaming gate/up differs from the kernel's");
}  // namespace

// x [tokens, H] bf16; topk_ids [tokens * top_k]; w_gu [E, 2I, H] e4m3 with s_gu [E, 2I / 128,
// ceil(H / 128)]; w_sh [2 Is, H] with s_sh [2 Is / 128, ceil(H / 128)] or null; act
// [tokens * top_k, I], act_sh [tokens, Is]. tokens <= 8, H % 16 == 0, I and Is multiples of 128
// (a tile's 8 gate rows share a scale row, as do its up rows), 16-byte aligned rows.
// Grid (splits, tokens * top_k * I / (8 WARPS) + Is / (8 WARPS)), cluster (splits, 1, 1) when
// splits > 1; dynamic shared memory MOE_GATE_UP_STREAM_SMEM.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
    moe_gate_up_fp8_stream(const bf16* __restrict__ x, int hidden, int tokens, const int* __restrict__ topk_ids,
                           int top_k, const uint8_t* __restrict__ w_gu, const float* __restrict__ s_gu, int im,
                           const uint8_t* __restrict__ w_sh, const float* __restrict__ s_sh, int ims,
                           bf16* __restrict__ act, bf16* __restrict__ act_sh) {
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int splits = gridDim.x, split = blockIdx.x;
    const int k_blocks = (hidden + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
    const int per = (k_blocks + splits - 1) / splits;
    const int kb0 = min(k_blocks, split * per), n_stages = min(k_blocks, kb0 + per) - kb0;
    uint8_t* ring = smem + warp * STAGES * STAGE_BYTES;
    float* red = reinterpret_cast<float*>(smem + WARPS * STAGES * STAGE_BYTES);  // [WARPS][4][32]

    const int cta_cols = WARPS * COLS;
    const int routed_ctas = tokens * top_k * (im / cta_cols);
    const bool shared = (int)blockIdx.y >= routed_ctas;
    const int slot = shared ? -1 : (int)blockIdx.y / (im / cta_cols);
    const int j0 =
        (shared ? (int)blockIdx.y - routed_ctas : (int)blockIdx.y % (im / cta_cols)) * cta_cols + warp * COLS;
    const int width = shared ? ims : im;  // gate rows 0..width-1, up rows width..2 width-1
    const int m_rows = shared ? tokens : 1;

    const uint8_t* wrow[2];
    const float* srow[2];
    const int rows[2] = {j0 + g, width + j0 + g};
    // The expert's matrix: the shared one is known now; a routed one only once routing is done.
    auto locate = [&](const uint8_t* w, const float* sc) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            wrow[rr] = w + (size_t)rows[rr] * hidden;
            srow[rr] = sc + (size_t)((rows[rr] - g) / FP8_SCALE_BLOCK) * k_blocks + kb0;
        }
    };
    auto issue_w = [&](int i) {
        uint8_t* st = ring + (i % STAGES) * STAGE_BYTES;
        stream_issue_w(st, 0, wrow, (kb0 + i) * FP8_SCALE_BLOCK + t * 16, hidden, lane);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) cp_async_4_ca(st + SCALES_AT + (rr * 32 + lane) * 4, srow[rr] + i);
    };
    const bf16* xrow = nullptr;
    bool has_x = false;
    auto issue_x = [&](int i) {
        if (!has_x) return;
        uint8_t* st = ring + (i % STAGES) * STAGE_BYTES;
        stream_issue_x(st, W_CHUNKS, xrow, (kb0 + i) * FP8_SCALE_BLOCK + t * 16, hidden, lane);
    };

    if (shared) {
        locate(w_sh, s_sh);
#pragma unroll
        for (int p = 0; p < STAGES - 1; ++p)
            if (p < n_stages) issue_w(p);
    }
    PDL_ENTRY();
    if (!shared) {
        const size_t e = (size_t)topk_ids[slot];  // written by moe_route: a plain load
        locate(w_gu + e * 2 * im * hidden, s_gu + e * (2 * im / FP8_SCALE_BLOCK) * k_blocks);
#pragma unroll
        for (int p = 0; p < STAGES - 1; ++p)
            if (p < n_stages) issue_w(p);
    }
    // MMA column g is token g of the shared experts' CTAs; a routed CTA has its slot's token only.
    has_x = g < m_rows;
    xrow = x + (size_t)(shared ? min(g, tokens - 1) : slot / top_k) * hidden;
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) {
        if (p < n_stages) issue_x(p);
        cp_async_commit();
    }

    // acc: gate of column j0 + g for tokens 2t, 2t + 1, then up for the same.
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < n_stages; ++i) {
        if (i + STAGES - 1 < n_stages) {
            issue_w(i + STAGES - 1);
            issue_x(i + STAGES - 1);
        }
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        const uint8_t* st = ring + (i % STAGES) * STAGE_BYTES;
        uint32_t xw[2][8];
        stream_read_x(st, W_CHUNKS, lane, has_x, xw);
        float c[4] = {0.f, 0.f, 0.f, 0.f};  // rows g (gate) and g + 8 (up) by tokens 2t, 2t + 1
        stream_mma_tile(st, 0, lane, xw, c);
        const float sg = *reinterpret_cast<const float*>(st + SCALES_AT + lane * 4);
        const float su = *reinterpret_cast<const float*>(st + SCALES_AT + (32 + lane) * 4);
        acc[0] = fmaf(c[0], sg, acc[0]);
        acc[1] = fmaf(c[1], sg, acc[1]);
        acc[2] = fmaf(c[2], su, acc[2]);
        acc[3] = fmaf(c[3], su, acc[3]);
    }
    cp_async_wait<0>();

    // Token pair half p (0: token 2t, 1: token 2t + 1) from the summed gate and up.
    auto store = [&](int p, float gate, float up) {
        const int m = 2 * t + p;
        if (m >= m_rows) return;
        const float gr = round_bf16(gate);
        const bf16 v = to_bf16(round_bf16(gr / (1.f + __expf(-gr))) * round_bf16(up));
        if (shared)
            act_sh[(size_t)m * ims + j0 + g] = v;
        else
            act[(size_t)slot * im + j0 + g] = v;
    };
    if (splits == 1) {
        store(0, acc[0], acc[2]);
        store(1, acc[1], acc[3]);
        return;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) red[(warp * 4 + e) * 32 + lane] = acc[e];
    cluster_sync_all();
    // Rank r sums, in rank order, the token halves p with p % splits == r.
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        if (p % splits != split) continue;
        const float* pg = red + (warp * 4 + p) * 32 + lane;
        const float* pu = red + (warp * 4 + 2 + p) * 32 + lane;
        float gate = 0.f, up = 0.f;
        for (int r = 0; r < splits; ++r) {
            gate += ld_dsmem_f32(pg, r);
            up += ld_dsmem_f32(pu, r);
        }
        store(p, gate, up);
    }
    cluster_sync_all();  // no CTA leaves while another still reads its partials
}
