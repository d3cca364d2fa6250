// Grouped GEMM for MoE experts on Hopper warpgroup MMA (sm_90a cubin only): the same function as
// moe_grouped_gemm in grouped_gemm.cu, C[rows of expert e] = A[rows] · W[e]ᵀ over the device tile
// map of moe_align (128-row tiles), so routing and permutation never leave the device.
//
// Work item = one 128-row tile x BN weight rows (BN = 256 for prefill-sized batches, 128 when
// experts get at most 64 rows, so that decode steps have twice as many items to spread over the
// SMs). Two warpgroups of 64 rows each issue wgmma m64nBNk16 with both operands in shared memory
// (K-major, 128-byte swizzle); a warpgroup whose 64 rows are all past the tile's end issues none,
// so a tile's ragged tail costs half. Blocks take items round-robin in tile-major order, the
// count read from the device tile map; each block runs one continuous stream of 64-wide K slices
// over all its items through a cp.async ring of STAGES slices (192 KB, one block per SM), copying
// slice g + STAGES - 2 while slice g is multiplied and slice g - 1's wgmma may still be in flight
// (wait_group 1). The grid decides the schedule (Kernels::moe_sm90_schedule): persistent, one
// block per SM, whose stream crosses item boundaries so the next item's first slices are in
// flight while an item's epilogue stores its results (decode-sized batches, memory-bound), or
// one block per worst-case item, each running a single item (prefill-sized batches; measured
// faster there on the H200, docs/cuda-notes.md).
//
// moe_grouped_gemm_silu_sm90* are the gate/up GEMM with SiLU·mul in the epilogue: an item's BN
// weight rows are BN/2 gate rows [n0, n0+BN/2) and the matching BN/2 up rows [I+n0, ...) of the
// fused [2I, K] weight, so every thread holds gate column c in accumulator i and up column c in
// accumulator i + BN/4, and writes act[row, c] = bf16(round_bf16(silu(g)) · u) straight from
// registers, with g and u first rounded to bf16 as the unfused GEMM output would be (the same
// rounding as silu_mul in elementwise.cu). The [rows, 2I] intermediate is never written.
//
// Partial tiles in rows, N and K are zero-filled on load and masked on store; N and K must be
// multiples of 8 (16-byte copies; checked by the Rust wrapper).
#include "wgmma.cuh"

// Dynamic shared memory (the Rust wrapper computes the same): STAGES x (128 + BN) x 128 bytes
// (BN 256: 4 stages, BN 128: 6 stages; 192 KB either way) + 1024 bytes of alignment slack.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace {
constexpr int GG_BM = 128, GG_BK = 64;
}  // namespace

// SILU == false: W is [E, N, K], C is [rows, N], item columns n0 = BN · column block.
// SILU == true:  W is [E, 2N, K] (gate rows then up rows), C is [rows, N] = act, n0 = BN/2 · block.
template <bool SILU, int BN>
DEVICE_INLINE void grouped_gemm_sm90(const bf16* __restrict__ A, const bf16* __restrict__ W, bf16* __restrict__ C, int N,
                                     int K, const int* __restrict__ tile_expert, const int* __restrict__ tile_row0,
                                     const int* __restrict__ tile_rows, const int* __restrict__ num_tiles) {
    constexpr int STAGES = BN == 256 ? 4 : 6, LEAD = STAGES - 2, NACC = BN / 2;
    constexpr int COLS = SILU ? BN / 2 : BN;  // output columns per item
    constexpr uint32_t A_BYTES = GG_BM * GG_BK * 2, STAGE_BYTES = (GG_BM + BN) * GG_BK * 2;
    const int col_blocks = (N + COLS - 1) / COLS;
    const int items = num_tiles[0] * col_blocks;
    const int my_items = blockIdx.x < items ? (items - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    if (my_items == 0) return;
    const int KT = (K + GG_BK - 1) / GG_BK;
    const int slices = my_items * KT;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t s_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const int w_rows = SILU ? 2 * N : N;
    const int tid = threadIdx.x;
    // Uniform per warp through a shuffle, so ptxas does not serialise the wgmmas under it.
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);

    // The item of this block's j-th turn: (expert, first grouped row, rows, first column).
    struct Item {
        int e, row0, rows, n0;
    };
    auto item_of = [&](int j) {
        const int it = blockIdx.x + j * gridDim.x, tile = it / col_blocks;
        return Item{tile_expert[tile], tile_row0[tile], tile_rows[tile], (it - tile * col_blocks) * COLS};
    };

    // Loader: slice g of the stream = K slice g % KT of turn g / KT. Chunk c = tid + 256 i covers
    // row c / 8, 16-byte chunk c % 8 of the 64-wide slice.
    Item li = item_of(0);
    int l_turn = 0;
    auto load = [&](int g) {
        const int turn = g / KT, kt = g - turn * KT;
        if (turn != l_turn) {
            li = item_of(turn);
            l_turn = turn;
        }
        const int k0 = kt * GG_BK;
        const uint32_t sA = s_base + (g % STAGES) * STAGE_BYTES, sB = sA + A_BYTES;
        const bf16* We = W + (size_t)li.e * w_rows * K;
#pragma unroll
        for (int i = 0; i < GG_BM * 8 / 256; ++i) {
            const int c = tid + 256 * i, r = c >> 3, ch = c & 7;
            const bool ok = r < li.rows && k0 + ch * 8 < K;
            cp_async_16s(sA + sw128_offset(GG_BM, r, ch), ok ? A + (size_t)(li.row0 + r) * K + k0 + ch * 8 : A, ok);
        }
#pragma unroll
        for (int i = 0; i < BN * 8 / 256; ++i) {
            const int c = tid + 256 * i, r = c >> 3, ch = c & 7;
            int n;
            bool ok;
            if (SILU) {
                const int j = li.n0 + (r % (BN / 2));  // gate/up column of this row
                ok = j < N;
                n = r < BN / 2 ? j : N + j;
            } else {
                n = li.n0 + r;
                ok = n < N;
            }
            ok = ok && k0 + ch * 8 < K;
            cp_async_16s(sB + sw128_offset(BN, r, ch), ok ? We + (size_t)n * K + k0 + ch * 8 : W, ok);
        }
    };

    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

    // LEAD slices ahead: the stage refilled at slice g was last read by slice g - 2's wgmma, which
    // every warpgroup has retired (wait_group 1 at slice g - 1) before the barrier of slice g.
#pragma unroll
    for (int s = 0; s < LEAD; ++s) {
        if (s < slices) load(s);
        cp_async_commit();
    }
    const int lane = tid & 31, warp = (tid >> 5) & 3, gq = lane >> 2, t4 = lane & 3;
    for (int turn = 0, g = 0; turn < my_items; ++turn) {
        const Item ci = item_of(turn);
        // A warpgroup with no rows in this tile skips its MMAs (block-uniform, hence warp-uniform).
        const bool active = __shfl_sync(0xffffffffu, wg * 64 < ci.rows, 0);
        for (int kt = 0; kt < KT; ++kt, ++g) {
            cp_async_wait<LEAD - 1>();  // this thread's copies of slice g have landed
            fence_proxy_async();        // generic-proxy writes before the async-proxy reads
            __syncthreads();            // everyone's copies of g landed; slice g - 2 retired
            if (g + LEAD < slices) load(g + LEAD);
            cp_async_commit();
            if (active) {
                const uint32_t sA = s_base + (g % STAGES) * STAGE_BYTES, sB = sA + A_BYTES;
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < GG_BK / 16; ++kk) {
                    const uint64_t da = sw128_desc(sA + wg * 64 * 128 + kk * 32, 16, 1024);
                    const uint64_t db = sw128_desc(sB + kk * 32, 16, 1024);
                    if constexpr (BN == 256)
                        wgmma_m64n256k16_ss(acc, da, db, 1);
                    else
                        wgmma_m64n128k16_ss(acc, da, db, 1);
                }
                wgmma_commit();
                wgmma_wait<1>();
                reg_fence(acc);
            }
        }
        // Retire the item's last slice and store (the next item's first slices are in flight).
        wgmma_wait<0>();
        reg_fence(acc);
        if (!active) continue;
        // Accumulator i: row 16·warp + gq (+8 for i % 4 >= 2), column 8·(i / 4) + 2·t4 + (i % 2).
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = wg * 64 + warp * 16 + gq + half * 8;
            if (r >= ci.rows) continue;
            bf16* dst = C + (size_t)(ci.row0 + r) * N + ci.n0 + 2 * t4;
            if constexpr (SILU) {
#pragma unroll
                for (int j = 0; j < BN / 16; ++j) {
                    if (ci.n0 + j * 8 + 2 * t4 >= N) continue;
                    float o[2];
#pragma unroll
                    for (int b = 0; b < 2; ++b) {
                        const float gt = round_bf16(acc[4 * j + 2 * half + b]);
                        const float up = round_bf16(acc[BN / 4 + 4 * j + 2 * half + b]);
                        o[b] = round_bf16(gt / (1.f + __expf(-gt))) * up;
                    }
                    *reinterpret_cast<uint32_t*>(dst + j * 8) = pack_bf16(o[0], o[1]);
                }
            } else {
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
                    if (ci.n0 + j * 8 + 2 * t4 < N)
                        *reinterpret_cast<uint32_t*>(dst + j * 8) = pack_bf16(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
            }
        }
#pragma unroll
        for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
    }
    cp_async_wait<0>();
}
#endif

#define GROUPED_GEMM_SM90_ARGS                                                                                \
    const bf16 *__restrict__ A, const bf16 *__restrict__ W, bf16 *__restrict__ C, int N, int K,             \
        const int *__restrict__ tile_expert, const int *__restrict__ tile_row0, const int *__restrict__ tile_rows, \
        const int *__restrict__ num_tiles

// Grid: one block per SM (persistent) or per worst-case item. C = A · W[e]ᵀ (N output columns per row), or with
// _silu act = silu(A · gateᵀ) · (A · upᵀ), W = [E, 2N, K]. _n128: items of 128 weight rows.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GG_BODY(SILU, BN) grouped_gemm_sm90<SILU, BN>(A, W, C, N, K, tile_expert, tile_row0, tile_rows, num_tiles)
#else
#define GG_BODY(SILU, BN)
#endif
extern "C" __global__ void __launch_bounds__(256, 1) moe_grouped_gemm_sm90(GROUPED_GEMM_SM90_ARGS) { PDL_ENTRY(); GG_BODY(false, 256); }
extern "C" __global__ void __launch_bounds__(256, 1) moe_grouped_gemm_silu_sm90(GROUPED_GEMM_SM90_ARGS) { PDL_ENTRY(); GG_BODY(true, 256); }
extern "C" __global__ void __launch_bounds__(256, 1) moe_grouped_gemm_sm90_n128(GROUPED_GEMM_SM90_ARGS) { PDL_ENTRY(); GG_BODY(false, 128); }
extern "C" __global__ void __launch_bounds__(256, 1) moe_grouped_gemm_silu_sm90_n128(GROUPED_GEMM_SM90_ARGS) { PDL_ENTRY(); GG_BODY(true, 128); }
