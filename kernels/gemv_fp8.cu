// Skinny linear layers on block-FP8 weights (W8A16, issue 12's decode path): y[m, n] = sum_k
// x[m, k] * W[n, k] * scale_inv[n / 128][k / 128], W e4m3 row-major [N, K] as DeepSeek-V3
// checkpoints store it with one f32 scale per 128x128 block (edge blocks partial), x bf16
// [M <= GEMV_KERNEL_MAX_ROWS, K] at a row stride, f32 accumulation, bf16 or f32 output. The same
// scheme as gemv.cu's bf16 kernel with half the weight bytes: each warp owns ROWS output rows and
// streams them with 16-byte loads (16 weights), dequantizing in registers. A 16-weight chunk never
// crosses a 128-wide scale block, so each chunk's partial sum is scaled once.
#include "fp8_stream.cuh"

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

// The same function on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate): a warp takes 16
// weight rows, the 8 warps of a block split K by 128-wide scale blocks (block kb to warp kb % 8)
// and sum through shared memory. e4m3 values are exact in bf16, and x is bf16, so each MMA's
// products are exact and summed in f32, as the FMA kernel sums them; each scale block's MMAs
// accumulate from zero and are scaled once into the row's sum. The MMA's K order is a
// permutation of K (the sum does not depend on its order): lane (g, t) loads 16 consecutive weights of
// rows g and g + 8 and the same 16 inputs of token g, and its MMA fragments hold, for each of
// the 4 k16 steps, 4 of them, which A's and B's layouts both place at k = 2t, 2t+1, 2t+8,
// 2t+9 of the step. Tokens past m_rows (up to 8) are zero. The FMA kernel spends M FMAs and a
// conversion per weight and is issue-bound at 4 rows; here an MMA covers 16 x 8 x 16.
namespace {
constexpr int MMA_WARPS = 8, MMA_UNROLL = 2;

DEVICE_INLINE uint32_t e4m3x2_to_bf16x2(uint16_t v) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(v, __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);  // exact: e4m3 has 4 significant bits
    return *reinterpret_cast<const uint32_t*>(&b);
}

}  // namespace

// Grid: ceil(N / 16) blocks of 32 * MMA_WARPS threads. K % 16 == 0, x_stride % 8 == 0, W and x
// 16-byte aligned (the wrapper checks); m_rows <= 8.
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)
    gemv_fp8_mma(const uint8_t* __restrict__ w, const float* __restrict__ scale_inv, int n_rows, int k_len,
                 const __nv_bfloat16* __restrict__ x, int x_stride, int m_rows, void* __restrict__ y, int y_stride,
                 int out_f32) {
    __shared__ float partial[MMA_WARPS][32][4];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * 16;
    if (warp == 0 && lane < 16 && row0 + lane < n_rows) prefetch_l2(w + (size_t)(row0 + lane) * k_len, (unsigned)k_len);
    PDL_ENTRY();
    const int k_blocks = (k_len + SCALE_BLOCK - 1) / SCALE_BLOCK;
    const uint8_t* wa = w + (size_t)min(row0 + g, n_rows - 1) * k_len;
    const uint8_t* wb = w + (size_t)min(row0 + g + 8, n_rows - 1) * k_len;
    const __nv_bfloat16* xr = x + (size_t)min(g, m_rows - 1) * x_stride;
    const float* scales = scale_inv + (size_t)(row0 / SCALE_BLOCK) * k_blocks;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // MMA_UNROLL scale blocks per iteration (blocks kb and kb + MMA_WARPS, ...): every load of
    // an iteration is issued before its first MMA, 256 bytes of weights per lane in flight.
    for (int kb0 = warp; kb0 < k_blocks; kb0 += MMA_WARPS * MMA_UNROLL) {
        uint4 va[MMA_UNROLL][2], vb[MMA_UNROLL][2], xv[MMA_UNROLL][2][2];
        float s[MMA_UNROLL];
#pragma unroll
        for (int u = 0; u < MMA_UNROLL; ++u) {
            const int kb = kb0 + u * MMA_WARPS;
            s[u] = __ldg(scales + min(kb, k_blocks - 1));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // Every load is issued (from a clamped, valid address) and zeroed afterwards where
                // it falls past K or the tokens, so that none waits behind a branch.
                const int k = kb * SCALE_BLOCK + h * 64 + t * 16, kc = min(k, k_len - 16);
                const bool ok = kb < k_blocks && k < k_len, xok = ok && g < m_rows;
                const uint4 zero = make_uint4(0, 0, 0, 0);
                const uint4 a = __ldg(reinterpret_cast<const uint4*>(wa + kc));
                const uint4 b = __ldg(reinterpret_cast<const uint4*>(wb + kc));
                const uint4 x0 = __ldg(reinterpret_cast<const uint4*>(xr + kc));
                const uint4 x1 = __ldg(reinterpret_cast<const uint4*>(xr + kc) + 1);
                va[u][h] = ok ? a : zero;
                vb[u][h] = ok ? b : zero;
                xv[u][h][0] = xok ? x0 : zero;
                xv[u][h][1] = xok ? x1 : zero;
            }
        }
#pragma unroll
        for (int u = 0; u < MMA_UNROLL; ++u) {
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint16_t* pa = reinterpret_cast<const uint16_t*>(&va[u][h]);
                const uint16_t* pb = reinterpret_cast<const uint16_t*>(&vb[u][h]);
                const uint32_t* px = reinterpret_cast<const uint32_t*>(&xv[u][h][0]);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    // Step j: weights 4j..4j+3 of this lane's 16 (rows g, g + 8) and the same inputs.
                    const uint32_t a[4] = {e4m3x2_to_bf16x2(pa[2 * j]), e4m3x2_to_bf16x2(pb[2 * j]),
                                           e4m3x2_to_bf16x2(pa[2 * j + 1]), e4m3x2_to_bf16x2(pb[2 * j + 1])};
                    mma_bf16_16816(c, a, px[2 * j], px[2 * j + 1]);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] = fmaf(c[i], s[u], acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][lane][i] = acc[i];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float v = 0.f;
#pragma unroll
        for (int ww = 0; ww < MMA_WARPS; ++ww) v += partial[ww][lane][i];
        // c[i]: row g (i < 2) or g + 8, token 2t + (i & 1).
        const int n = row0 + g + (i >> 1) * 8, m = 2 * t + (i & 1);
        if (n >= n_rows || m >= m_rows) continue;
        const size_t at = (size_t)m * y_stride + n;
        if (out_f32)
            reinterpret_cast<float*>(y)[at] = v;
        else
            reinterpret_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(v);
    }
}

// The streaming kernel of 1 to 8 rows (issue 29): the tensor-core kernel's fragments and exact
// products, fed from a per-lane ring of shared memory and split over K across the CTAs of a
// thread-block cluster, so that every SM has tens of KB of weights in flight whatever N is.
//
// - A warp owns TILES tiles of 16 weight rows and walks the scale blocks of its CTA's K range.
//   Each lane copies, with cp.async, exactly the 16-byte chunks (weights of rows g and g + 8,
//   inputs of token g, the tile's scale) that it will itself read back, into STAGES slots of a
//   ring: so no barrier is needed, only cp.async.wait_group, and STAGES - 1 scale blocks of
//   every warp are in flight while one is multiplied.
// - e4m3 to bf16 takes three integer operations and one bf16x2 multiply per pair of weights,
//   and no conversion instruction (the conversion pipe, 16 results per clock and SM, bounded
//   the MMA kernel): the byte is sign-extended to 16 bits, shifted left by 4 and masked, which
//   places sign, exponent and mantissa where bf16 has them, a bf16 worth w * 2^-120 (subnormal
//   for e4m3's subnormals), then multiplied by 2^120, exact. The NaN codes (0x7f, 0xff), absent
//   from checkpoints, become +-480.
// - The weight copies of the first stages are issued before the programmatic-launch wait (the
//   weights do not depend on the preceding kernel), the inputs after it.
// - Split K: blockIdx.x is the split and the cluster rank (cluster dims (splits, 1, 1), set by
//   the launcher; splits == 1 launches no cluster). Each CTA leaves its f32 partial sums in its
//   shared memory; after a cluster barrier, rank r sums, for the outputs it owns, the partials
//   of ranks 0, 1, ... in that order through distributed shared memory: deterministic, no
//   workspace, no atomics. Only sm_90 has clusters: the PTX fallback takes splits == 1.
namespace {
template <int TILES>
struct StreamLayout {
    static constexpr int W_CHUNKS = 4 * TILES;   // 16-byte weight chunks per lane and stage
    static constexpr int CHUNKS = W_CHUNKS + 4;  // and 4 of inputs (32 bytes per 64-wide half)
    static constexpr int STAGE_BYTES = CHUNKS * 32 * 16 + TILES * 32 * 4;
};

template <int WARPS, int TILES, int STAGES>
DEVICE_INLINE void gemv_fp8_stream_body(const uint8_t* __restrict__ w, const float* __restrict__ scale_inv, int n_rows,
                                        int k_len, const __nv_bfloat16* __restrict__ x, int x_stride, int m_rows,
                                        void* __restrict__ y, int y_stride, int out_f32, int flags) {
    using L = StreamLayout<TILES>;
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int splits = gridDim.x, split = blockIdx.x;
    const int k_blocks = (k_len + SCALE_BLOCK - 1) / SCALE_BLOCK;
    const int per = (k_blocks + splits - 1) / splits;
    const int kb0 = min(k_blocks, split * per), n_stages = min(k_blocks, kb0 + per) - kb0;
    constexpr int CTA_ROWS = WARPS * TILES * 16;
    const int cta_row0 = blockIdx.y * CTA_ROWS, warp_row0 = cta_row0 + warp * TILES * 16;
    uint8_t* ring = smem + warp * STAGES * L::STAGE_BYTES;
    float* red = reinterpret_cast<float*>(smem + WARPS * STAGES * L::STAGE_BYTES);  // [WARPS][TILES * 4][32]

    if ((flags & 1) && n_stages > 0) {  // the CTA's weight rows over its K range into L2
        const int k_lo = kb0 * SCALE_BLOCK, k_hi = min(k_len, (kb0 + n_stages) * SCALE_BLOCK);
        for (int r = threadIdx.x; r < CTA_ROWS; r += 32 * WARPS)
            if (cta_row0 + r < n_rows) prefetch_l2(w + (size_t)(cta_row0 + r) * k_len + k_lo, (unsigned)(k_hi - k_lo));
    }
    // Rows past N read row N - 1 (their sums are not written).
    const uint8_t* wrow[TILES][2];
    const float* srow[TILES];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
        const int r0 = warp_row0 + tile * 16;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) wrow[tile][rr] = w + (size_t)min(r0 + g + 8 * rr, n_rows - 1) * k_len;
        srow[tile] = scale_inv + (size_t)(min(r0, n_rows - 1) / SCALE_BLOCK) * k_blocks + kb0;
    }
    const __nv_bfloat16* xrow = x + (size_t)min(g, m_rows - 1) * x_stride;
    const bool has_x = g < m_rows;

    auto issue_w = [&](int i) {
        uint8_t* st = ring + (i % STAGES) * L::STAGE_BYTES;
        const int kbase = (kb0 + i) * SCALE_BLOCK + t * 16;
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
            stream_issue_w(st, tile * 4, wrow[tile], kbase, k_len, lane);
            cp_async_4_ca(st + L::CHUNKS * 512 + (tile * 32 + lane) * 4, srow[tile] + i);
        }
    };
    auto issue_x = [&](int i) {
        if (!has_x) return;
        uint8_t* st = ring + (i % STAGES) * L::STAGE_BYTES;
        stream_issue_x(st, L::W_CHUNKS, xrow, (kb0 + i) * SCALE_BLOCK + t * 16, k_len, lane);
    };

#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p)
        if (p < n_stages) issue_w(p);
    PDL_ENTRY();
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) {
        if (p < n_stages) issue_x(p);
        cp_async_commit();
    }

    float acc[TILES][4];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[tile][i] = 0.f;
    for (int i = 0; i < n_stages; ++i) {
        if (i + STAGES - 1 < n_stages) {
            issue_w(i + STAGES - 1);
            issue_x(i + STAGES - 1);
        }
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        const uint8_t* st = ring + (i % STAGES) * L::STAGE_BYTES;
        uint32_t xw[2][8];
        stream_read_x(st, L::W_CHUNKS, lane, has_x, xw);
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
            const float s = *reinterpret_cast<const float*>(st + L::CHUNKS * 512 + (tile * 32 + lane) * 4);
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            stream_mma_tile(st, tile * 4, lane, xw, c);
#pragma unroll
            for (int i2 = 0; i2 < 4; ++i2) acc[tile][i2] = fmaf(c[i2], s, acc[tile][i2]);
        }
    }
    cp_async_wait<0>();

    // c[i] of tile: row warp_row0 + 16 tile + g + 8 (i >> 1), token 2t + (i & 1).
    auto store = [&](int e, float v) {
        const int tile = e >> 2, i = e & 3;
        const int n = warp_row0 + tile * 16 + g + (i >> 1) * 8, m = 2 * t + (i & 1);
        if (n >= n_rows || m >= m_rows) return;
        const size_t at = (size_t)m * y_stride + n;
        if (out_f32)
            reinterpret_cast<float*>(y)[at] = v;
        else
            reinterpret_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(v);
    };
    if (splits == 1) {
#pragma unroll
        for (int e = 0; e < TILES * 4; ++e) store(e, acc[e >> 2][e & 3]);
        return;
    }
#pragma unroll
    for (int e = 0; e < TILES * 4; ++e) red[(warp * TILES * 4 + e) * 32 + lane] = acc[e >> 2][e & 3];
    cluster_sync_all();
#pragma unroll
    for (int e = 0; e < TILES * 4; ++e) {
        if (e % splits != split) continue;
        const float* p = red + (warp * TILES * 4 + e) * 32 + lane;
        float v = 0.f;
        for (int r = 0; r < splits; ++r) v += ld_dsmem_f32(p, r);
        store(e, v);
    }
    cluster_sync_all();  // no CTA leaves while another still reads its partials
}
}  // namespace

// Grid: (splits, ceil(N / (16 WARPS TILES))) blocks of 32 WARPS threads, cluster (splits, 1, 1)
// when splits > 1 (sm_90 only); dynamic shared memory GEMV_FP8_STREAM_SMEM(WARPS, TILES, STAGES).
// K % 16 == 0, x_stride % 8 == 0, W and x 16-byte aligned, m_rows <= 8. flags bit 0: prefetch the
// CTA's weights into L2 first.
#define GEMV_FP8_STREAM(WARPS, TILES, STAGES)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) gemv_fp8_stream_w##WARPS##t##TILES##s##STAGES(       \
        const uint8_t* __restrict__ w, const float* __restrict__ scale_inv, int n_rows, int k_len,                \
        const __nv_bfloat16* __restrict__ x, int x_stride, int m_rows, void* __restrict__ y, int y_stride,        \
        int out_f32, int flags) {                                                                                 \
        gemv_fp8_stream_body<WARPS, TILES, STAGES>(w, scale_inv, n_rows, k_len, x, x_stride, m_rows, y, y_stride, \
                                                   out_f32, flags);                                               \
    }                                                                                                             \
    static_assert(WARPS * (STAGES * StreamLayout<TILES>::STAGE_BYTES + TILES * 4 * 32 * 4) ==                     \
                      GEMV_FP8_STREAM_SMEM_W##WARPS##T##TILES##S##STAGES,                                         \
                  "dims.cuh's shared memory of the streaming GEMV differs from the kernel's")
GEMV_FP8_STREAM(4, 1, 4);
GEMV_FP8_STREAM(4, 2, 4);
GEMV_FP8_STREAM(8, 1, 6);
GEMV_FP8_STREAM(2, 1, 8);
GEMV_FP8_STREAM(4, 1, 6);
GEMV_FP8_STREAM(8, 2, 3);
