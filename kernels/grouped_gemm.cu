// Grouped GEMM for MoE experts: C[rows of expert e] = A[rows] · W[e]ᵀ, where A holds the token rows
// grouped by expert (moe_align) and W[e] is expert e's nn.Linear weight [N, K]. The tile map built
// on the device says which expert and rows each tile covers, so the launch needs no host knowledge
// of the routing: the grid covers the worst case and idle tiles exit at once.
//
// bf16 mma.sync with f32 accumulation, multi-stage cp.async pipeline. Needs N and K multiples of 8
// (16-byte loads; checked by the Rust wrapper); partial tiles in N and K are zero-filled, so small
// test models work too.
//
// The _fp8 kernels take block-FP8 expert weights (e4m3 bytes [E, N, K] with one f32 scale_inv per
// 128x128 block of each expert, [E, ceil(N / 128), ceil(K / 128)]): each thread loads its 8-byte
// chunks of the next weight slice into registers before the current slice's MMAs and, after
// them, stores each weight to shared memory as bf16(float(e4m3) * scale), the value a host
// dequantization to bf16 gives, so the MMAs see exactly the bf16 kernel's operands on such
// weights (outputs are bitwise equal). The A operand is staged as in the bf16 kernels.
#include "fp8.cuh"

// Two tile shapes from one template: 64 x 128 (prefill: many rows per expert) and 16 x 64 with a
// deeper pipeline (decode: a handful of rows per expert, so the weights' stream must be spread over
// many blocks to reach memory bandwidth). The tile map (moe_align) is built for the same BM.
// WT = bf16, or uint8_t for block-FP8 weights with scale_inv (unused for bf16).
template <int BM, int BN, int BK, int WM, int WN, int STAGES, typename WT>
__device__ __forceinline__ void grouped_gemm(const bf16* __restrict__ A, const WT* __restrict__ W,
                                             const float* __restrict__ scale_inv, bf16* __restrict__ C, int N, int K,
                                             const int* __restrict__ tile_expert, const int* __restrict__ tile_row0,
                                             const int* __restrict__ tile_rows, const int* __restrict__ num_tiles) {
    constexpr bool FP8 = sizeof(WT) == 1;
    constexpr int NTHREADS = 128, SSTRIDE = BK + 8;  // +16 bytes per row: conflict-free fragments
    constexpr int MT = WM / 16, NT = WN / 8, WARPS_N = BN / WN;
    static_assert((BM / WM) * WARPS_N == 4, "four warps per block");
    const int tile = blockIdx.y;
    if (tile >= num_tiles[0]) return;
    __shared__ __align__(16) bf16 As[STAGES][BM * SSTRIDE];
    __shared__ __align__(16) bf16 Bs[STAGES][BN * SSTRIDE];

    const int e = tile_expert[tile], row0 = tile_row0[tile], rows = tile_rows[tile];
    const int n0 = blockIdx.x * BN;
    const WT* Wt = W + (size_t)e * N * K + (size_t)n0 * K;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;

    auto load = [&](int kt, int stage) {
        const int k0 = kt * BK;
        for (int c = tid; c < BM * (BK / 8); c += NTHREADS) {
            const int r = c / (BK / 8), d = (c % (BK / 8)) * 8;
            const bool ok = r < rows && k0 + d < K;
            cp_async_16(&As[stage][r * SSTRIDE + d], ok ? A + (size_t)(row0 + r) * K + k0 + d : A, ok);
        }
        if constexpr (!FP8) {
            for (int c = tid; c < BN * (BK / 8); c += NTHREADS) {
                const int r = c / (BK / 8), d = (c % (BK / 8)) * 8;
                const bool ok = n0 + r < N && k0 + d < K;
                cp_async_16(&Bs[stage][r * SSTRIDE + d], ok ? Wt + (size_t)r * K + k0 + d : W, ok);
            }
        }
    };

    // FP8 weights: thread tid's chunks of 8 weights are c = tid + NTHREADS i of the slice, fetched
    // with their block scales into registers, then dequantized into a stage (zeros outside N, K).
    constexpr int B_CHUNKS = BN * (BK / 8) / NTHREADS;
    static_assert(!FP8 || B_CHUNKS * NTHREADS == BN * (BK / 8), "FP8 weight slice: whole chunks per thread");
    uint2 b_raw[FP8 ? B_CHUNKS : 1];
    float b_scale[FP8 ? B_CHUNKS : 1];
    const int k_blocks = (K + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
    const float* St = scale_inv + (size_t)e * ((N + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK) * k_blocks;
    auto fetch_b = [&](int kt) {
        const int k0 = kt * BK;
#pragma unroll
        for (int i = 0; i < B_CHUNKS; ++i) {
            const int c = tid + i * NTHREADS, r = c / (BK / 8), d = (c % (BK / 8)) * 8;
            const bool ok = n0 + r < N && k0 + d < K;
            b_raw[i] = ok ? __ldg(reinterpret_cast<const uint2*>(Wt + (size_t)r * K + k0 + d)) : make_uint2(0, 0);
            b_scale[i] =
                ok ? __ldg(St + (size_t)((n0 + r) / FP8_SCALE_BLOCK) * k_blocks + (k0 + d) / FP8_SCALE_BLOCK) : 0.f;
        }
    };
    auto store_b = [&](int stage) {
#pragma unroll
        for (int i = 0; i < B_CHUNKS; ++i) {
            const int c = tid + i * NTHREADS, r = c / (BK / 8), d = (c % (BK / 8)) * 8;
            *reinterpret_cast<uint4*>(&Bs[stage][r * SSTRIDE + d]) = fp8x8_dequant_bf16(b_raw[i], b_scale[i]);
        }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

    const int KT = (K + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) {
            load(s, s);
            if constexpr (FP8) {
                fetch_b(s);
                store_b(s);
            }
        }
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int nk = kt + STAGES - 1;
        if (nk < KT) {
            load(nk, nk % STAGES);
            if constexpr (FP8) fetch_b(nk);  // lands during this slice's MMAs
        }
        cp_async_commit();
        const bf16* a_s = As[kt % STAGES];
        const bf16* b_s = Bs[kt % STAGES];
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            uint32_t a[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const bf16* p = a_s + (wm + i * 16 + g) * SSTRIDE + ks * 16 + 2 * t4;
                a[i][0] = lds32(p);
                a[i][1] = lds32(p + 8 * SSTRIDE);
                a[i][2] = lds32(p + 8);
                a[i][3] = lds32(p + 8 * SSTRIDE + 8);
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const bf16* p = b_s + (wn + j * 8 + g) * SSTRIDE + ks * 16 + 2 * t4;
                const uint32_t b0 = lds32(p), b1 = lds32(p + 8);
#pragma unroll
                for (int i = 0; i < MT; ++i) mma_bf16_16816(acc[i][j], a[i], b0, b1);
            }
        }
        // Stage nk % STAGES was last read in slice kt - 1, which every thread finished before this
        // slice's barrier; the next barrier orders these stores before slice nk's reads.
        if constexpr (FP8)
            if (nk < KT) store_b(nk % STAGES);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = wm + i * 16 + g + half * 8;
            if (r >= rows) continue;
            bf16* dst = C + (size_t)(row0 + r) * N + n0 + wn;
#pragma unroll
            for (int j = 0; j < NT; ++j)
                if (n0 + wn + j * 8 + 2 * t4 < N)
                    *reinterpret_cast<uint32_t*>(dst + j * 8 + 2 * t4) =
                        pack_bf16(acc[i][j][2 * half], acc[i][j][2 * half + 1]);
        }
    }
}

#define GROUPED_GEMM_ARGS                                                                                          \
    const bf16 *__restrict__ A, const bf16 *__restrict__ W, bf16 *__restrict__ C, int N, int K,                    \
        const int *__restrict__ tile_expert, const int *__restrict__ tile_row0, const int *__restrict__ tile_rows, \
        const int *__restrict__ num_tiles
#define GROUPED_GEMM_FP8_ARGS                                                                                       \
    const bf16 *__restrict__ A, const uint8_t *__restrict__ W, const float *__restrict__ scale_inv,                 \
        bf16 *__restrict__ C, int N, int K, const int *__restrict__ tile_expert, const int *__restrict__ tile_row0, \
        const int *__restrict__ tile_rows, const int *__restrict__ num_tiles
// The two tile shapes (a tile map built for the same rows), on either weight format.
#define ROWS64_TILE GROUPED_TILE_M, 128, 32, 32, 64, 3
#define ROWS16_TILE GROUPED_TILE_M_SMALL, 64, 64, 16, 16, 4

#define GROUPED_GEMM_KERNEL(NAME, TILE, ARGS, SCALES)                                            \
    extern "C" __global__ void __launch_bounds__(128) NAME(ARGS) {                               \
        PDL_ENTRY();                                                                             \
        grouped_gemm<TILE>(A, W, SCALES, C, N, K, tile_expert, tile_row0, tile_rows, num_tiles); \
    }

// Tiles of 64 rows x 128 columns (prefill), and of 16 rows x 64 columns with 4 stages of 64-wide
// K slices (decode); then the same two on block-FP8 weights.
GROUPED_GEMM_KERNEL(moe_grouped_gemm, ROWS64_TILE, GROUPED_GEMM_ARGS, nullptr)
GROUPED_GEMM_KERNEL(moe_grouped_gemm_small, ROWS16_TILE, GROUPED_GEMM_ARGS, nullptr)
GROUPED_GEMM_KERNEL(moe_grouped_gemm_fp8, ROWS64_TILE, GROUPED_GEMM_FP8_ARGS, scale_inv)
GROUPED_GEMM_KERNEL(moe_grouped_gemm_small_fp8, ROWS16_TILE, GROUPED_GEMM_FP8_ARGS, scale_inv)
