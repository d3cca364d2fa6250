// Skinny linear layers: y[m, n] = sum_k x[m, k] * W[n, k], W bf16 row-major [N, K] (the HF
// layout), x bf16 [M <= 4, K] at a row stride, f32 accumulation, bf16 or f32 output. Each warp
// owns ROWS output rows and streams them with 16-byte loads, UNROLL chunks of 256 elements in
// flight per row, then reduces across the warp. Measured on the H200 (docs/runs/2026-11-22.md, runs
// S4/S5): the lm_head (419 MB) at 4.3 TB/s, but 2-25 MB projections at 6-10 us per launch, where
// cuBLAS's M = 1 kernels take about as long; B=1 decode 279 -> 289 tok/s, B=4 slower than cuBLAS
// (687 -> 601), and a K-split-over-the-block variant was no faster at B=1 and slower on the
// lm_head. The model uses it for single-row steps only. UNROLL went 2 -> 8 (a whole 2048-wide
// row in flight per lane: one memory round trip instead of four), with the MoE GEMVs' U 4 -> 8
// and the norm gain loaded before the PDL wait: B=1 decode 2.70 -> 2.61 ms per step (H200,
// 2026-11-22, part of it from the decode-attention kernel in the same build).
#include "common.cuh"

namespace {
constexpr int MAXM = GEMV_KERNEL_MAX_ROWS, ROWS = 2, UNROLL = 8, WARPS = 4;
static_assert(WARPS * ROWS == GEMV_ROWS_PER_BLOCK, "gemv: dims.cuh's rows per block differ from the kernel's");

__device__ __forceinline__ void bf16x8_to_f32(const uint4& v, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p = __bfloat1622float2(h[i]);
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}
}  // namespace

// Grid: ceil(N / (WARPS * ROWS)) (+ ceil(N2 / (WARPS * ROWS))) blocks of 32 * WARPS threads. K % 8 == 0, x_stride % 8 == 0,
// W, x 16-byte aligned (the wrapper checks).
extern "C" __global__ void __launch_bounds__(32 * WARPS)
    gemv_bf16(const __nv_bfloat16* __restrict__ w, int n_rows, int k_len, const __nv_bfloat16* __restrict__ x,
              int x_stride, int m_rows, void* __restrict__ y, int y_stride, int out_f32,
              const __nv_bfloat16* __restrict__ w2, int n_rows2, void* __restrict__ y2, int y2_stride) {
    // Blocks past the first matrix's take a second one over the same x (q and kv_a of a layer
    // both read the normed hidden state: one launch instead of two).
    int block = blockIdx.x;
    const int blocks1 = (n_rows + WARPS * ROWS - 1) / (WARPS * ROWS);
    if (block >= blocks1) {
        block -= blocks1;
        w = w2;
        n_rows = n_rows2;
        y = y2;
        y_stride = y2_stride;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (block * WARPS + warp) * ROWS;
    // The weights do not depend on the previous kernel: pull this warp's rows towards L2 while
    // that kernel is still running (programmatic dependent launch, common.cuh), then wait for x.
    if (row0 < n_rows && lane == 0)
        prefetch_l2(w + (size_t)row0 * k_len, (unsigned)(min(ROWS, n_rows - row0) * k_len * 2));
    PDL_ENTRY();
    if (row0 >= n_rows) return;
    float acc[ROWS][MAXM];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[r][m] = 0.f;
    const uint4* wv[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
        wv[r] = reinterpret_cast<const uint4*>(w + (size_t)min(row0 + r, n_rows - 1) * k_len);
    const int chunks = k_len / 8;  // 16-byte chunks per row
    for (int c0 = lane; c0 < chunks; c0 += 32 * UNROLL) {
        uint4 wc[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const int c = c0 + 32 * u;
                wc[u][r] = c < chunks ? __ldg(wv[r] + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + 32 * u;
            if (c >= chunks) break;
#pragma unroll
            for (int m = 0; m < MAXM; ++m) {
                if (m >= m_rows) break;
                float xf[8];
                bf16x8_to_f32(__ldg(reinterpret_cast<const uint4*>(x + (size_t)m * x_stride) + c), xf);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    float wf[8];
                    bf16x8_to_f32(wc[u][r], wf);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][m] = fmaf(wf[i], xf[i], acc[r][m]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m)
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], off);
    if (lane != 0) return;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int n = row0 + r;
        if (n >= n_rows) break;
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (m >= m_rows) break;
            const size_t at = (size_t)m * y_stride + n;
            if (out_f32)
                reinterpret_cast<float*>(y)[at] = acc[r][m];
            else
                reinterpret_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(acc[r][m]);
        }
    }
}
