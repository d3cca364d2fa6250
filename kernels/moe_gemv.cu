// DeepSeekMoE for steps of a few tokens (decode at small batch), as weight-streaming GEMVs: a
// B=1 step reads 6 of 64 experts per layer, and the grouped-GEMM path spends 12 launches per
// layer on it (f32 conversion, cuBLAS router, routing, alignment, gather, two grouped GEMMs, the
// shared expert's three kernels, combine), each a few microseconds of latency. Here the layer is
// router GEMV -> moe_route (moe.cu) -> gate/up GEMV -> down GEMV, with the routed experts and the
// shared experts in the same launches, SiLU·mul in the gate/up epilogue and the weighted combine
// in the down epilogue. Rounding follows HF as the grouped path does (moe.cu, elementwise.cu):
// gate, up and silu rounded to bf16, each expert's output rounded to bf16 before its weight, the
// routed sum rounded to bf16 before the shared experts' bf16 output is added.
//
// The gate/up and down kernels are templates on the expert weights' format: bf16, or block-FP8
// (e4m3 bytes, one f32 scale_inv per 128x128 block of each expert matrix, DeepSeek-V3's
// checkpoint layout; the _fp8 kernels). FP8 weights stream as 16-byte chunks of 16 weights,
// dequantized in registers to f32: a chunk's 16 products are summed in f32, then scaled by its
// block's scale (a chunk never crosses a 128-wide block), as gemv_fp8.cu does. The epilogues
// and their bf16 rounding points are the same for both formats. Routed and shared experts share
// the format of a launch.
#include "fp8.cuh"

namespace {
constexpr int WARPS = MOE_GEMV_WARPS;  // warps per block of the router and gate/up kernels
constexpr int U = 8;  // 16-byte chunks in flight per lane and row (a whole 2048-wide row: one round trip)

// Kept apart from gemv.cu's bf16x8_to_f32 on purpose: routing this through that helper (same
// arithmetic, same order) compiled to a B=1 decode step 5% slower on the H200 (2.32 -> 2.43 ms,
// run H15 in docs/runs/2026-11-22.md).
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
    const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p = __bfloat1622float2(x[i]), q = __bfloat1622float2(y[i]);
        s = fmaf(p.x, q.x, s);
        s = fmaf(p.y, q.y, s);
    }
    return s;
}

// Chunks c0 + 32 i (i < U) of two weight rows and, with WITH_V, of a vector; zeros past `chunks`.
template <bool WITH_V>
__device__ __forceinline__ void load_chunks(const uint4* __restrict__ r0, const uint4* __restrict__ r1,
                                            const uint4* __restrict__ v, int c0, int chunks, uint4 (&w0)[U],
                                            uint4 (&w1)[U], uint4 (&x)[U]) {
#pragma unroll
    for (int i = 0; i < U; ++i) {
        const int c = c0 + 32 * i;
        const bool in = c < chunks;
        w0[i] = in ? __ldg(r0 + c) : make_uint4(0, 0, 0, 0);
        w1[i] = in ? __ldg(r1 + c) : make_uint4(0, 0, 0, 0);
        if constexpr (WITH_V) x[i] = in ? __ldg(v + c) : make_uint4(0, 0, 0, 0);
    }
}

// Per-lane partial dots of two weight rows with one vector, `chunks` 16-byte chunks long.
__device__ __forceinline__ void dot2_rows(const uint4* __restrict__ r0, const uint4* __restrict__ r1,
                                          const uint4* __restrict__ v, int chunks, int lane, float& a0, float& a1) {
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
        uint4 w0[U], w1[U], x[U];
        load_chunks<true>(r0, r1, v, c0, chunks, w0, w1, x);
#pragma unroll
        for (int i = 0; i < U; ++i) {
            a0 += dot8(w0[i], x[i]);
            a1 += dot8(w1[i], x[i]);
        }
    }
}

// Adds loaded FP8 chunks c0 + 32 i (i < U, those below `chunks`) of two rows, dotted with the
// vector's chunks, into a0 / a1: each chunk's 16 products summed in f32, then scaled by its block's
// scale (s0 / s1 point at the rows' scale-grid row, chunk c's scale is (coff + c) / 8).
__device__ __forceinline__ void add_fp8_chunks(const uint4 (&w0)[U], const uint4 (&w1)[U], const float* __restrict__ s0,
                                               const float* __restrict__ s1, int coff, const bf16* __restrict__ v,
                                               int c0, int chunks, float& a0, float& a1) {
    constexpr int CHUNKS_PER_BLOCK = FP8_SCALE_BLOCK / 16;
#pragma unroll
    for (int i = 0; i < U; ++i) {
        const int c = c0 + 32 * i;
        if (c >= chunks) break;
        float xf[16], f0[16], f1[16];
        bf16x16_to_f32(v + (size_t)c * 16, xf);
        fp8x16_to_f32(w0[i], f0);
        fp8x16_to_f32(w1[i], f1);
        float p0 = 0.f, p1 = 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            p0 = fmaf(f0[j], xf[j], p0);
            p1 = fmaf(f1[j], xf[j], p1);
        }
        const int b = (coff + c) / CHUNKS_PER_BLOCK;
        a0 = fmaf(p0, __ldg(s0 + b), a0);
        a1 = fmaf(p1, __ldg(s1 + b), a1);
    }
}

// dot2_rows for FP8 rows of `chunks` 16-weight chunks: s0 / s1 point at the rows' scale-grid row
// (their 128-row block's scales), and chunk c of the rows has scale (coff + c) / 8, coff being the
// rows' first column in chunks (a slice of a wider matrix).
__device__ __forceinline__ void dot2_rows_fp8(const uint4* __restrict__ r0, const uint4* __restrict__ r1,
                                              const float* __restrict__ s0, const float* __restrict__ s1, int coff,
                                              const bf16* __restrict__ v, int chunks, int lane, float& a0, float& a1) {
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
        uint4 w0[U], w1[U];
        load_chunks<false>(r0, r1, nullptr, c0, chunks, w0, w1, w1);
        add_fp8_chunks(w0, w1, s0, s1, coff, v, c0, chunks, a0, a1);
    }
}

// Whether a weight type is FP8 (e4m3 bytes with block scales) rather than bf16.
template <typename WT>
constexpr bool is_fp8 = sizeof(WT) == 1;
}  // namespace

// logits[m, e] = f32(x[m, :]) · w[e, :] with f32 router weights, as HF computes the gate
// (hidden states cast to f32). One block per (token, expert), its WARPS warps each summing a
// contiguous quarter of the row, added in warp order (the same bits whatever the batch). One
// warp per (token, expert), as before, kept 8 KB of loads in flight per SM on 64 SMs and took
// 13 us for V3's 7.3 MB of f32 router at batch 1 (run S31); a quarter row per warp, eight loads
// deep, spreads the same bytes over every SM. hidden % (4 WARPS) == 0.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
    moe_router_gemv(const bf16* __restrict__ x, const float* __restrict__ w, int tokens, int experts, int hidden,
                    float* __restrict__ logits) {
    __shared__ float part[WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int m = blockIdx.x / experts, e = blockIdx.x - m * experts;
    const int per = hidden / 4 / WARPS;  // float4 columns of this warp's quarter
    const float4* wr = reinterpret_cast<const float4*>(w + (size_t)e * hidden) + warp * per;
    if (lane == 0) prefetch_l2(wr, (unsigned)(per * 16));
    PDL_ENTRY();
    if (m >= tokens) return;
    const uint2* xr = reinterpret_cast<const uint2*>(x + (size_t)m * hidden) + warp * per;
    float acc = 0.f;
#pragma unroll 8
    for (int c = lane; c < per; c += 32) {
        const float4 wv = __ldg(wr + c);
        const uint2 xv = __ldg(xr + c);
        const float2 x01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xv.x));
        const float2 x23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xv.y));
        acc = fmaf(wv.x, x01.x, acc);
        acc = fmaf(wv.y, x01.y, acc);
        acc = fmaf(wv.z, x23.x, acc);
        acc = fmaf(wv.w, x23.y, acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < WARPS; ++i) sum += part[i];
        logits[(size_t)m * experts + e] = sum;
    }
}

// act[slot, n] = silu(x[m] · gate_e[n]) * (x[m] · up_e[n]) for every routed slot (token m =
// slot / top_k, expert e = topk_ids[slot]; w_gu = [E, 2I, H]), then act_sh[m, n] likewise with
// the shared experts' [2 * Is, H] (when w_sh is not null). One warp per output element at a time,
// reading the gate and up rows together; the grid is one wave of resident blocks and each warp
// strides over the items, so the last wave is not a ragged tail. hidden % 8 == 0, rows 16-byte
// aligned. FP8 (WT = uint8_t): s_gu = [E, 2I / 128, ceil(H / 128)] and s_sh = [2 Is / 128,
// ceil(H / 128)] (I and Is multiples of 128, so gate and up rows never share a scale block),
// hidden % 16 == 0.
// The gate/up launch's arguments, and where its items lie: item i < routed is column
// n = i % im of routed slot i / im, the rest the shared experts' column n of token m.
template <typename WT>
struct GateUpArgs {
    const bf16* x;
    int hidden, tokens;
    const int* topk_ids;
    int top_k;
    const WT* w_gu;
    const float* s_gu;
    int im;
    const WT* w_sh;
    const float* s_sh;
    int ims;
    bf16* act;
    bf16* act_sh;

    DEVICE_INLINE long long routed() const { return (long long)tokens * top_k * im; }
    DEVICE_INLINE long long total() const { return routed() + (w_sh ? (long long)tokens * ims : 0); }
};

// One item's gate and up rows, their scale-grid rows (FP8), the token's activations and the
// output element.
template <typename WT>
struct GateUpRows {
    const uint4 *g, *u;
    const float *gs, *us;
    const bf16* x;
    bf16* out;
};

template <typename WT>
DEVICE_INLINE GateUpRows<WT> gate_up_rows(const GateUpArgs<WT>& a, long long item) {
    // FP8: scales per 128-row block of the stacked [rows, H] matrices (each expert's rows a
    // multiple of 128, so a row's block is its stacked index / 128).
    const int kb = (a.hidden + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
    const long long routed = a.routed();
    const WT *g_row, *u_row;
    GateUpRows<WT> r{};
    int m;
    if (item < routed) {
        const int slot = (int)(item / a.im), n = (int)(item - (long long)slot * a.im);
        m = slot / a.top_k;
        const size_t e = (size_t)a.topk_ids[slot];
        g_row = a.w_gu + (e * 2 * a.im + n) * a.hidden;
        u_row = a.w_gu + (e * 2 * a.im + a.im + n) * a.hidden;
        if constexpr (is_fp8<WT>) {
            r.gs = a.s_gu + (e * 2 * a.im + n) / FP8_SCALE_BLOCK * kb;
            r.us = a.s_gu + (e * 2 * a.im + a.im + n) / FP8_SCALE_BLOCK * kb;
        }
        r.out = a.act + (size_t)slot * a.im + n;
    } else {
        const long long i = item - routed;
        m = (int)(i / a.ims);
        const int n = (int)(i - (long long)m * a.ims);
        g_row = a.w_sh + (size_t)n * a.hidden;
        u_row = a.w_sh + (size_t)(a.ims + n) * a.hidden;
        if constexpr (is_fp8<WT>) {
            r.gs = a.s_sh + (size_t)(n / FP8_SCALE_BLOCK) * kb;
            r.us = a.s_sh + (size_t)((a.ims + n) / FP8_SCALE_BLOCK) * kb;
        }
        r.out = a.act_sh + (size_t)m * a.ims + n;
    }
    r.g = reinterpret_cast<const uint4*>(g_row);
    r.u = reinterpret_cast<const uint4*>(u_row);
    r.x = a.x + (size_t)m * a.hidden;
    return r;
}

// The shared experts' rows do not depend on the routing: lane 0 starts pulling this warp's
// (items first, first + stride, ...) into L2 before the launch waits on the routing.
template <typename WT>
DEVICE_INLINE void prefetch_shared_rows(const GateUpArgs<WT>& a, long long first, long long stride) {
    const long long routed = a.routed(), total = a.total();
    if ((threadIdx.x & 31) != 0) return;
    for (long long item = first < routed ? first + ((routed - first + stride - 1) / stride) * stride : first;
         item < total; item += stride) {
        const int n = (int)((item - routed) % a.ims);
        prefetch_l2(a.w_sh + (size_t)n * a.hidden, (unsigned)(a.hidden * sizeof(WT)));
        prefetch_l2(a.w_sh + (size_t)(a.ims + n) * a.hidden, (unsigned)(a.hidden * sizeof(WT)));
    }
}

// An item's output from its lanes' partial gate and up sums: HF's rounding of gate, up and
// silu(gate) to bf16.
DEVICE_INLINE void store_silu_mul(bf16* out, float g, float u, int lane) {
    g = round_bf16(warp_sum(g));
    u = round_bf16(warp_sum(u));
    if (lane == 0) *out = to_bf16(round_bf16(g / (1.f + __expf(-g))) * u);
}

template <typename WT>
DEVICE_INLINE void moe_gemv_gate_up_body(const GateUpArgs<WT> a) {
    const int lane = threadIdx.x & 31;
    const long long first = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
    const long long stride = (long long)gridDim.x * WARPS;
    prefetch_shared_rows(a, first, stride);
    PDL_ENTRY();
    for (long long item = first; item < a.total(); item += stride) {
        const GateUpRows<WT> r = gate_up_rows(a, item);
        float g = 0.f, u = 0.f;
        if constexpr (is_fp8<WT>)
            dot2_rows_fp8(r.g, r.u, r.gs, r.us, 0, r.x, a.hidden / 16, lane, g, u);
        else
            dot2_rows(r.g, r.u, reinterpret_cast<const uint4*>(r.x), a.hidden / 8, lane, g, u);
        store_silu_mul(r.out, g, u, lane);
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS)
    moe_gemv_gate_up(const bf16* __restrict__ x, int hidden, int tokens, const int* __restrict__ topk_ids, int top_k,
                     const bf16* __restrict__ w_gu, int im, const bf16* __restrict__ w_sh, int ims,
                     bf16* __restrict__ act, bf16* __restrict__ act_sh) {
    moe_gemv_gate_up_body(
        GateUpArgs<bf16>{x, hidden, tokens, topk_ids, top_k, w_gu, nullptr, im, w_sh, nullptr, ims, act, act_sh});
}

extern "C" __global__ void __launch_bounds__(32 * WARPS)
    moe_gemv_gate_up_fp8(const bf16* __restrict__ x, int hidden, int tokens, const int* __restrict__ topk_ids,
                         int top_k, const uint8_t* __restrict__ w_gu, const float* __restrict__ s_gu, int im,
                         const uint8_t* __restrict__ w_sh, const float* __restrict__ s_sh, int ims,
                         bf16* __restrict__ act, bf16* __restrict__ act_sh) {
    moe_gemv_gate_up_body(
        GateUpArgs<uint8_t>{x, hidden, tokens, topk_ids, top_k, w_gu, s_gu, im, w_sh, s_sh, ims, act, act_sh});
}

// moe_gemv_gate_up_fp8 held to 5 blocks an SM (at most 102 registers: 96, no spills, against
// 122): 2,640 resident warps on an H200 where 4 blocks give 2,112, so a B = 1 step of a TP-8
// rank of V3 (2,304 items of 14 KB) runs in one wave instead of leaving 192 items for a second.
// Under ncu (run S56) 19.3 -> 16.2 us at one token, 29.3 -> 26.8 at two, 39.9 -> 36.0 at three;
// on V2-Lite (rows of 2,048, many items a warp) it lost 1% at B = 1, so `MoeGemvKernels` takes
// it for rows of at least `FIVE_BLOCKS_MIN_K_BLOCKS` scale blocks. The same body: the same bits.
extern "C" __global__ void __launch_bounds__(32 * WARPS, 5)
    moe_gemv_gate_up_fp8_5b(const bf16* __restrict__ x, int hidden, int tokens, const int* __restrict__ topk_ids,
                            int top_k, const uint8_t* __restrict__ w_gu, const float* __restrict__ s_gu, int im,
                            const uint8_t* __restrict__ w_sh, const float* __restrict__ s_sh, int ims,
                            bf16* __restrict__ act, bf16* __restrict__ act_sh) {
    moe_gemv_gate_up_body(
        GateUpArgs<uint8_t>{x, hidden, tokens, topk_ids, top_k, w_gu, s_gu, im, w_sh, s_sh, ims, act, act_sh});
}

// Output row r of a token from the warps' partial sums part[warp][r] (the top_k routed experts'
// warps, then `pieces` warps of the shared experts): HF's rounding, each expert's output to bf16
// before its weight `w[j]`, the routed sum to bf16, then the shared experts' sum to bf16 and added.
template <int ROWS>
DEVICE_INLINE float combine_row(const float (*part)[ROWS], int r, const float* __restrict__ w, int top_k, int pieces) {
    float routed = 0.f;
    for (int j = 0; j < top_k; ++j) routed += w[j] * round_bf16(part[j][r]);
    float y = round_bf16(routed);
    if (pieces > 0) {
        float sh = 0.f;
        for (int q = 0; q < pieces; ++q) sh += part[top_k + q][r];
        y += round_bf16(sh);
    }
    return y;
}

template <typename WT>
DEVICE_INLINE void moe_gemv_down_body(const bf16* __restrict__ act, int im, const WT* __restrict__ w_d,
                                      const float* __restrict__ s_d, const int* __restrict__ topk_ids,
                                      const float* __restrict__ topk_w, int top_k, const bf16* __restrict__ act_sh,
                                      int ims, const WT* __restrict__ w_sh_d, const float* __restrict__ s_sh_d,
                                      int pieces, bf16* __restrict__ out, int hidden) {
    __shared__ float part[32][2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int m = blockIdx.y;
    const bool is_shared = warp >= top_k;
    const int p = warp - top_k;
    if (is_shared && lane == 0)
        for (int n = blockIdx.x * 2; n < hidden; n += gridDim.x * 2) {
            prefetch_l2(w_sh_d + (size_t)n * ims + (size_t)p * im, (unsigned)(im * sizeof(WT)));
            prefetch_l2(w_sh_d + (size_t)(n + 1) * ims + (size_t)p * im, (unsigned)(im * sizeof(WT)));
        }
    PDL_ENTRY();
    const int hb = (hidden + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
    for (int n = blockIdx.x * 2; n < hidden; n += gridDim.x * 2) {
        const WT *r0, *r1;
        const bf16* v;
        const float* sc = nullptr;
        int coff = 0;
        if (!is_shared) {
            const int slot = m * top_k + warp;
            const size_t e = (size_t)topk_ids[slot];
            r0 = w_d + (e * hidden + n) * im;
            r1 = r0 + im;
            v = act + (size_t)slot * im;
            if constexpr (is_fp8<WT>)
                sc = s_d + (e * hb + n / FP8_SCALE_BLOCK) * ((im + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK);
        } else {
            r0 = w_sh_d + (size_t)n * ims + (size_t)p * im;
            r1 = r0 + ims;
            v = act_sh + (size_t)m * ims + (size_t)p * im;
            if constexpr (is_fp8<WT>) {
                sc = s_sh_d + (size_t)(n / FP8_SCALE_BLOCK) * ((ims + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK);
                coff = p * im / 16;
            }
        }
        float a0 = 0.f, a1 = 0.f;
        if constexpr (is_fp8<WT>)
            dot2_rows_fp8(reinterpret_cast<const uint4*>(r0), reinterpret_cast<const uint4*>(r1), sc, sc, coff, v,
                          im / 16, lane, a0, a1);
        else
            dot2_rows(reinterpret_cast<const uint4*>(r0), reinterpret_cast<const uint4*>(r1),
                      reinterpret_cast<const uint4*>(v), im / 8, lane, a0, a1);
        a0 = warp_sum(a0);
        a1 = warp_sum(a1);
        if (lane == 0) {
            part[warp][0] = a0;
            part[warp][1] = a1;
        }
        __syncthreads();
        if (threadIdx.x < 2)
            out[(size_t)m * hidden + n + threadIdx.x] =
                to_bf16(combine_row<2>(part, threadIdx.x, topk_w + m * top_k, top_k, pieces));
        __syncthreads();  // part is rewritten by the next row pair
    }
}

// moe_gemv_down_fp8 for narrow experts, I <= 32 * 16 (a tensor-parallel rank's share of V3's: 256
// at --tp 8), where a row is at most one 16-byte chunk per lane. There the kernel above has each
// warp load one chunk of two rows, reduce, and meet the block at a barrier for every row pair:
// 512 bytes in flight per warp, and a V3 TP-8 rank's down projection (16.5 MB at batch 1) took
// 26 us, 0.6 TB/s (run S33, ncu). Here a block takes DOWN_ROWS output rows per round, each warp
// loading its chunk of all of them before any arithmetic, its activation chunk converted once
// for the whole launch, and one barrier per round; each row's sum runs in the same order as
// above (one chunk per lane, then the warp, then the combine), so the outputs are the same bits.
// The rows of a round share one 128-row scale block (hidden % DOWN_ROWS == 0).
constexpr int DOWN_ROWS = 8;

extern "C" __global__ void moe_gemv_down_fp8_narrow(const bf16* __restrict__ act, int im,
                                                    const uint8_t* __restrict__ w_d, const float* __restrict__ s_d,
                                                    const int* __restrict__ topk_ids, const float* __restrict__ topk_w,
                                                    int top_k, const bf16* __restrict__ act_sh, int ims,
                                                    const uint8_t* __restrict__ w_sh_d,
                                                    const float* __restrict__ s_sh_d, int pieces,
                                                    bf16* __restrict__ out, int hidden) {
    __shared__ float part[32][DOWN_ROWS];
    constexpr int CHUNKS_PER_BLOCK = FP8_SCALE_BLOCK / 16;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int m = blockIdx.y;
    const bool is_shared = warp >= top_k;
    const int p = warp - top_k;
    const int chunks = im / 16;
    const bool active = lane < chunks;
    const int hb = (hidden + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
    // This warp's matrix: row n starts at base + n * stride; scales at sbase + (n / 128) * sstride.
    const uint8_t* base;
    const float* sbase;
    size_t stride;
    int sstride, coff = 0;
    if (is_shared) {
        base = w_sh_d + (size_t)p * im;
        stride = ims;
        sbase = s_sh_d;
        sstride = (ims + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
        coff = p * im / 16;
        if (lane == 0)
            for (int n = blockIdx.x * DOWN_ROWS; n < hidden; n += gridDim.x * DOWN_ROWS)
                for (int r = 0; r < DOWN_ROWS; ++r) prefetch_l2(base + (size_t)(n + r) * stride, (unsigned)im);
    }
    PDL_ENTRY();
    if (!is_shared) {
        const size_t e = (size_t)topk_ids[m * top_k + warp];
        base = w_d + e * hidden * im;
        stride = im;
        sstride = (im + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
        sbase = s_d + e * hb * sstride;
    }
    const bf16* v = is_shared ? act_sh + (size_t)m * ims + (size_t)p * im : act + (size_t)(m * top_k + warp) * im;
    float xf[16];
    if (active) bf16x16_to_f32(v + (size_t)lane * 16, xf);
    const int sb = (coff + lane) / CHUNKS_PER_BLOCK;
    for (int n0 = blockIdx.x * DOWN_ROWS; n0 < hidden; n0 += gridDim.x * DOWN_ROWS) {
        uint4 w[DOWN_ROWS];
#pragma unroll
        for (int r = 0; r < DOWN_ROWS; ++r)
            w[r] = active ? __ldg(reinterpret_cast<const uint4*>(base + (size_t)(n0 + r) * stride) + lane)
                          : make_uint4(0, 0, 0, 0);
        const float scale = active ? __ldg(sbase + (size_t)(n0 / FP8_SCALE_BLOCK) * sstride + sb) : 0.f;
        float a[DOWN_ROWS];
#pragma unroll
        for (int r = 0; r < DOWN_ROWS; ++r) {
            float f[16];
            fp8x16_to_f32(w[r], f);
            float d = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) d = fmaf(f[j], xf[j], d);
            a[r] = active ? fmaf(d, scale, 0.f) : 0.f;
        }
#pragma unroll
        for (int r = 0; r < DOWN_ROWS; ++r) a[r] = warp_sum(a[r]);
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < DOWN_ROWS; ++r) part[warp][r] = a[r];
        __syncthreads();
        if (threadIdx.x < DOWN_ROWS)
            out[(size_t)m * hidden + n0 + threadIdx.x] =
                to_bf16(combine_row<DOWN_ROWS>(part, threadIdx.x, topk_w + m * top_k, top_k, pieces));
        __syncthreads();  // part is rewritten by the next round
    }
}

extern "C" __global__ void moe_gemv_down(const bf16* __restrict__ act, int im, const bf16* __restrict__ w_d,
                                         const int* __restrict__ topk_ids, const float* __restrict__ topk_w, int top_k,
                                         const bf16* __restrict__ act_sh, int ims, const bf16* __restrict__ w_sh_d,
                                         int pieces, bf16* __restrict__ out, int hidden) {
    moe_gemv_down_body(act, im, w_d, nullptr, topk_ids, topk_w, top_k, act_sh, ims, w_sh_d, nullptr, pieces, out,
                       hidden);
}

extern "C" __global__ void moe_gemv_down_fp8(const bf16* __restrict__ act, int im, const uint8_t* __restrict__ w_d,
                                             const float* __restrict__ s_d, const int* __restrict__ topk_ids,
                                             const float* __restrict__ topk_w, int top_k,
                                             const bf16* __restrict__ act_sh, int ims,
                                             const uint8_t* __restrict__ w_sh_d, const float* __restrict__ s_sh_d,
                                             int pieces, bf16* __restrict__ out, int hidden) {
    moe_gemv_down_body(act, im, w_d, s_d, topk_ids, topk_w, top_k, act_sh, ims, w_sh_d, s_sh_d, pieces, out, hidden);
}
