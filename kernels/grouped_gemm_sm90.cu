// Grouped GEMM for MoE experts on Hopper warpgroup MMA (sm_90a cubin only): the same function as
// moe_grouped_gemm in grouped_gemm.cu, C[rows of expert e] = A[rows] · W[e]ᵀ over the device tile
// map of moe_align (128-row tiles), so routing and permutation never leave the device.
//
// One block = one 128-row tile x 256 weight rows, two warpgroups of 64 rows each, each issuing
// wgmma m64n256k16 with both operands in shared memory (K-major, 128-byte swizzle). K runs in
// slices of 64 (one 128-byte swizzle row) through a 4-stage cp.async ring: slice kt + 2 is copied
// while slice kt is multiplied and slice kt - 1's wgmma may still be in flight (wait_group 1), so
// the tensor cores do not drain between slices. 48 KB per stage, 192 KB in all: one block per SM.
//
// moe_grouped_gemm_silu_sm90 is the gate/up GEMM with SiLU·mul in its epilogue: the block's 256
// weight rows are 128 gate rows [n0, n0+128) and the matching 128 up rows [I+n0, I+n0+128) of the
// fused [2I, K] weight, so every thread holds gate column c in accumulator i and up column c in
// accumulator i + 64, and writes act[row, c] = bf16(round_bf16(silu(g)) · u) straight from
// registers, with g and u first rounded to bf16 as the unfused GEMM output would be (the same
// rounding as silu_mul in elementwise.cu). The [rows, 2I] intermediate is never written.
//
// Partial tiles in rows, N and K are zero-filled on load and masked on store; N and K must be
// multiples of 8 (16-byte copies; checked by the Rust wrapper).
#include "wgmma.cuh"

// Dynamic shared memory (the Rust wrapper computes the same): 4 stages x 48 KB + 1024 bytes of
// alignment slack = 197632 bytes.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace {
constexpr int GG_BM = 128, GG_BN = 256, GG_BK = 64, GG_STAGES = 4;
constexpr uint32_t GG_A_BYTES = GG_BM * GG_BK * 2, GG_B_BYTES = GG_BN * GG_BK * 2;
constexpr uint32_t GG_STAGE_BYTES = GG_A_BYTES + GG_B_BYTES;
}  // namespace

// SILU == false: W is [E, N, K], C is [rows, N], block column n0 = 256 · blockIdx.x.
// SILU == true:  W is [E, 2N, K] (gate rows then up rows), C is [rows, N] = act, n0 = 128 · blockIdx.x.
template <bool SILU>
DEVICE_INLINE void grouped_gemm_sm90(const bf16* __restrict__ A, const bf16* __restrict__ W, bf16* __restrict__ C, int N,
                                     int K, const int* __restrict__ tile_expert, const int* __restrict__ tile_row0,
                                     const int* __restrict__ tile_rows, const int* __restrict__ num_tiles) {
    const int tile = blockIdx.y;
    if (tile >= num_tiles[0]) return;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t s_base = (smem_u32(smem_raw) + 1023u) & ~1023u;

    const int e = tile_expert[tile], row0 = tile_row0[tile], rows = tile_rows[tile];
    const int n0 = blockIdx.x * (SILU ? GG_BN / 2 : GG_BN);
    const int w_rows = SILU ? 2 * N : N;
    const bf16* We = W + (size_t)e * w_rows * K;
    const int tid = threadIdx.x;
    // Uniform per warp through a shuffle, so ptxas does not serialise the wgmmas under it.
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);

    // Per-thread copy assignments are fixed across K slices: chunk c = tid + 256 i covers row
    // c / 8, 16-byte chunk c % 8 of the 64-wide slice.
    auto load = [&](int kt, int stage) {
        const int k0 = kt * GG_BK;
        const uint32_t sA = s_base + stage * GG_STAGE_BYTES, sB = sA + GG_A_BYTES;
#pragma unroll
        for (int i = 0; i < GG_BM * 8 / 256; ++i) {
            const int c = tid + 256 * i, r = c >> 3, ch = c & 7;
            const bool ok = r < rows && k0 + ch * 8 < K;
            cp_async_16s(sA + sw128_offset(GG_BM, r, ch), ok ? A + (size_t)(row0 + r) * K + k0 + ch * 8 : A, ok);
        }
#pragma unroll
        for (int i = 0; i < GG_BN * 8 / 256; ++i) {
            const int c = tid + 256 * i, r = c >> 3, ch = c & 7;
            int n;
            bool ok;
            if (SILU) {
                const int j = n0 + (r & 127);  // gate/up column of this row
                ok = j < N;
                n = r < 128 ? j : N + j;
            } else {
                n = n0 + r;
                ok = n < N;
            }
            ok = ok && k0 + ch * 8 < K;
            cp_async_16s(sB + sw128_offset(GG_BN, r, ch), ok ? We + (size_t)n * K + k0 + ch * 8 : W, ok);
        }
    };

    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;

    const int KT = (K + GG_BK - 1) / GG_BK;
    // Two slices ahead: the stage refilled at slice kt was last read by slice kt - 2's wgmma, which
    // every warpgroup has retired (wait_group 1 at slice kt - 1) before the barrier of slice kt.
#pragma unroll
    for (int s = 0; s < GG_STAGES - 2; ++s) {
        if (s < KT) load(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<GG_STAGES - 3>();  // this thread's copies of slice kt have landed
        fence_proxy_async();             // generic-proxy writes before the async-proxy reads
        __syncthreads();                 // everyone's copies of kt landed; slice kt - 2 retired
        const int nk = kt + GG_STAGES - 2;
        if (nk < KT) load(nk, nk % GG_STAGES);
        cp_async_commit();
        const uint32_t sA = s_base + (kt % GG_STAGES) * GG_STAGE_BYTES, sB = sA + GG_A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < GG_BK / 16; ++kk) {
            const uint64_t da = sw128_desc(sA + wg * 64 * 128 + kk * 32, 16, 1024);
            const uint64_t db = sw128_desc(sB + kk * 32, 16, 1024);
            wgmma_m64n256k16_ss(acc, da, db, 1);
        }
        wgmma_commit();
        wgmma_wait<1>();
        reg_fence(acc);
    }
    wgmma_wait<0>();
    reg_fence(acc);
    cp_async_wait<0>();

    // Accumulator i of a thread: row 16·warp + g (+8 for i % 4 >= 2), column 8·(i / 4) + 2·t4 + (i % 2).
    const int lane = tid & 31, warp = (tid >> 5) & 3, g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = wg * 64 + warp * 16 + g + half * 8;
        if (r >= rows) continue;
        bf16* dst = C + (size_t)(row0 + r) * N + n0 + 2 * t4;
        if (SILU) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                if (n0 + j * 8 + 2 * t4 >= N) continue;
                float o[2];
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const float gt = round_bf16(acc[4 * j + 2 * half + b]);
                    const float up = round_bf16(acc[64 + 4 * j + 2 * half + b]);
                    o[b] = round_bf16(gt / (1.f + __expf(-gt))) * up;
                }
                *reinterpret_cast<uint32_t*>(dst + j * 8) = pack_bf16(o[0], o[1]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 32; ++j)
                if (n0 + j * 8 + 2 * t4 < N)
                    *reinterpret_cast<uint32_t*>(dst + j * 8) = pack_bf16(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
        }
    }
}
#endif

#define GROUPED_GEMM_SM90_ARGS                                                                                \
    const bf16 *__restrict__ A, const bf16 *__restrict__ W, bf16 *__restrict__ C, int N, int K,             \
        const int *__restrict__ tile_expert, const int *__restrict__ tile_row0, const int *__restrict__ tile_rows, \
        const int *__restrict__ num_tiles

// Grid: (ceil(N / 256), max tiles). C = A · W[e]ᵀ.
extern "C" __global__ void __launch_bounds__(256, 1) moe_grouped_gemm_sm90(GROUPED_GEMM_SM90_ARGS) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_gemm_sm90<false>(A, W, C, N, K, tile_expert, tile_row0, tile_rows, num_tiles);
#endif
}

// Grid: (ceil(I / 128), max tiles). act = silu(A · gateᵀ) · (A · upᵀ), W = [E, 2I, K], N = I.
extern "C" __global__ void __launch_bounds__(256, 1) moe_grouped_gemm_silu_sm90(GROUPED_GEMM_SM90_ARGS) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_gemm_sm90<true>(A, W, C, N, K, tile_expert, tile_row0, tile_rows, num_tiles);
#endif
}
