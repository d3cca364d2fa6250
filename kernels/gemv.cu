// Skinny linear layers for decode at batch <= 4: y[m, n] = sum_k x[m, k] * W[n, k], W bf16
// row-major [N, K] (the HF layout), x bf16 [M, K] at a row stride, f32 accumulation, bf16 or f32
// output. At M <= 4 a linear layer is one pass over its weights; cuBLAS's kernels for M = 1 read
// them at 1.37 TB/s on the H200 (ncu, run S1). A block owns RB output rows and splits K over all
// its 256 threads, so every 16-byte load of a row is issued at once even for the small
// matrices (576 x 2048 is 2.4 MB: latency, not bandwidth, is what a per-warp-row design paid for
// in run S4: 6-8 us per launch); warps reduce in registers, then across the block in shared
// memory.
#include <cuda_bf16.h>
#include <stdint.h>

namespace {
constexpr int MAXM = 4, RB = 2, THREADS = 256, WARPS = THREADS / 32, UNROLL = 2;

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

// Grid: ceil(N / RB) blocks of THREADS threads. K % 8 == 0, x_stride % 8 == 0, W and x 16-byte
// aligned (the wrapper checks).
extern "C" __global__ void __launch_bounds__(THREADS) gemv_bf16(
    const __nv_bfloat16* __restrict__ w, int n_rows, int k_len,
    const __nv_bfloat16* __restrict__ x, int x_stride, int m_rows,
    void* __restrict__ y, int y_stride, int out_f32) {
    __shared__ float red[WARPS][RB][MAXM];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row0 = blockIdx.x * RB;
    float acc[RB][MAXM];
#pragma unroll
    for (int r = 0; r < RB; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[r][m] = 0.f;
    const uint4* wv[RB];
#pragma unroll
    for (int r = 0; r < RB; ++r) wv[r] = reinterpret_cast<const uint4*>(w + (size_t)min(row0 + r, n_rows - 1) * k_len);
    const int chunks = k_len / 8;  // 16-byte chunks per row
    for (int c0 = tid; c0 < chunks; c0 += THREADS * UNROLL) {
        uint4 wc[UNROLL][RB];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < RB; ++r) {
                const int c = c0 + THREADS * u;
                wc[u][r] = c < chunks ? __ldg(wv[r] + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + THREADS * u;
            if (c >= chunks) break;
            float wf[RB][8];
#pragma unroll
            for (int r = 0; r < RB; ++r) bf16x8_to_f32(wc[u][r], wf[r]);
#pragma unroll
            for (int m = 0; m < MAXM; ++m) {
                if (m >= m_rows) break;
                float xf[8];
                bf16x8_to_f32(__ldg(reinterpret_cast<const uint4*>(x + (size_t)m * x_stride) + c), xf);
#pragma unroll
                for (int r = 0; r < RB; ++r)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][m] = fmaf(wf[r][i], xf[i], acc[r][m]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RB; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            float v = acc[r][m];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0) red[warp][r][m] = v;
        }
    __syncthreads();
    if (tid >= RB * MAXM) return;
    const int r = tid / MAXM, m = tid % MAXM, n = row0 + r;
    if (n >= n_rows || m >= m_rows) return;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) s += red[i][r][m];
    const size_t at = (size_t)m * y_stride + n;
    if (out_f32) reinterpret_cast<float*>(y)[at] = s;
    else reinterpret_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(s);
}
