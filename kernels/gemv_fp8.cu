// Skinny linear layers on block-FP8 weights (W8A16, issue 12's decode path): y[m, n] = sum_k
// x[m, k] * W[n, k] * scale_inv[n / 128][k / 128], W e4m3 row-major [N, K] as DeepSeek-V3
// checkpoints store it with one f32 scale per 128x128 block (edge blocks partial), x bf16
// [M <= GEMV_KERNEL_MAX_ROWS, K] at a row stride, f32 accumulation, bf16 or f32 output. The same
// scheme as gemv.cu's bf16 kernel with half the weight bytes: each warp owns ROWS output rows and
// streams them with 16-byte loads (16 weights), dequantizing in registers. A 16-weight chunk never
// crosses a 128-wide scale block, so each chunk's partial sum is scaled once.
#include "fp8.cuh"

namespace {
constexpr int MAXM = GEMV_KERNEL_MAX_ROWS, ROWS = 2, UNROLL = 8, WARPS = 4, SCALE_BLOCK = FP8_SCALE_BLOCK;
static_assert(WARPS * ROWS == GEMV_ROWS_PER_BLOCK, "gemv_fp8: dims.cuh's rows per block differ from the kernel's");
}  // namespace

// Grid: ceil(N / (WARPS * ROWS)) blocks of 32 * WARPS threads. K % 16 == 0, x_stride % 8 == 0,
// W and x 16-byte aligned (the wrapper checks).
extern "C" __global__ void __launch_bounds__(32 * WARPS)
    gemv_fp8_block(const uint8_t* __restrict__ w, const float* __restrict__ scale_inv, int n_rows, int k_len,
                   const __nv_bfloat16* __restrict__ x, int x_stride, int m_rows, void* __restrict__ y, int y_stride,
                   int out_f32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * WARPS + warp) * ROWS;
    if (row0 < n_rows && lane == 0) prefetch_l2(w + (size_t)row0 * k_len, (unsigned)(min(ROWS, n_rows - row0) * k_len));
    PDL_ENTRY();
    if (row0 >= n_rows) return;
    const int k_blocks = (k_len + SCALE_BLOCK - 1) / SCALE_BLOCK;
    float acc[ROWS][MAXM];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[r][m] = 0.f;
    const uint4* wv[ROWS];
    const float* scales[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int n = min(row0 + r, n_rows - 1);
        wv[r] = reinterpret_cast<const uint4*>(w + (size_t)n * k_len);
        scales[r] = scale_inv + (size_t)(n / SCALE_BLOCK) * k_blocks;
    }
    const int chunks = k_len / 16;  // 16-byte (16-weight) chunks per row
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
            const int kb = c * 16 / SCALE_BLOCK;
            float s[ROWS], wf[ROWS][16];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                s[r] = __ldg(scales[r] + kb);
                fp8x16_to_f32(wc[u][r], wf[r]);
            }
#pragma unroll
            for (int m = 0; m < MAXM; ++m) {
                if (m >= m_rows) break;
                float xf[16];
                bf16x16_to_f32(x + (size_t)m * x_stride + (size_t)c * 16, xf);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    float part = 0.f;
#pragma unroll
                    for (int i = 0; i < 16; ++i) part = fmaf(wf[r][i], xf[i], part);
                    acc[r][m] = fmaf(part, s[r], acc[r][m]);
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
