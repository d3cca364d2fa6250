// Grouped GEMM for MoE experts on Hopper warpgroup MMA (sm_90a cubin only): the same function as
// moe_grouped_gemm in grouped_gemm.cu, C[rows of expert e] = A[rows] · W[e]ᵀ over the device tile
// map of moe_align (128-row tiles), so routing and permutation never leave the device.
//
// Work item = one 128-row tile x BN weight rows (BN = 256 for prefill-sized batches, 128 when
// experts get at most 64 rows, so that decode steps have twice as many items to spread over the
// SMs). Blocks of 384 threads, warp-specialised: warpgroup 0 is the producer, copying every
// 64-wide K slice of the block's items (A rows and weight rows, K-major, 128-byte swizzle) into a
// ring of STAGES slices with cp.async, each thread signalling the stage's full mbarrier when its
// copies land (cp.async.mbarrier.arrive), so every stage of the ring can be in flight;
// warpgroups 1 and 2 (64 rows each) only wait on the full barrier, issue wgmma m64nBNk16 with
// both operands in shared memory, keep one wgmma group in flight (wait_group 1) and hand a stage
// back on its empty mbarrier once the wgmma that read it has retired, then store the item's
// results from registers. A consumer warpgroup whose 64 rows are all past the tile's end issues
// no MMAs (a tile's ragged tail costs half) but keeps the barrier protocol. No block barrier in
// the loop; the producer runs up to STAGES slices ahead, across item boundaries, so the next
// item's loads fly during an epilogue.
//
// Blocks take items round-robin in tile-major order, the count read from the device tile map.
// The grid decides the schedule (Kernels::moe_sm90_schedule): persistent, one block per SM
// (decode-sized batches, memory-bound), or one block per worst-case item (prefill-sized).
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
//
// The _fp8 kernels take block-FP8 weights (e4m3 bytes [E, N, K] (or [E, 2N, K]) with one f32
// scale_inv per 128x128 block of each expert): the producer copies A with cp.async as before and
// the weights' raw bytes with cp.async into a ring of two raw slices (slice kt + 1 in flight
// while slice kt is converted; each thread converts only the chunks it copied), then reads its
// chunks back, stores each weight as bf16(float(e4m3) * scale) into the same swizzled layout
// with st.shared, makes the stores visible to the async proxy and arrives on the stage's full
// barrier a second time (the barrier expects both the cp.async arrival and this one). The wgmma
// operands are exactly what the bf16 kernels read from weights dequantized on the host to bf16,
// so outputs are bitwise equal. The scales of slice kt + 1 are loaded into registers during
// slice kt. Requires N % 128 == 0 for the SILU kernels (the wrapper checks).
//
// The _w8a8 kernels (128-row items only) compute in FP8 on the tensor cores, as DeepGEMM, vLLM
// and SGLang do: A is e4m3 with one f32 scale per row and 128 columns (fp8_quantize_act), W
// block-FP8. Both are copied as stored with cp.async; a stage holds 128 values of K (the same
// 128-byte swizzled rows), and each stage's e4m3 wgmma products are promoted into the f32
// accumulators with their two scales (w8a8_item_k_loop), so the sum is f32 every 128 of K.
#include "fp8.cuh"
#include "wgmma.cuh"

// Dynamic shared memory (the Rust wrapper computes the same): STAGES x (128 + BN) x 128 bytes
// (BN 256: 4 stages, BN 128: 6 stages; 192 KB either way) + 1024 bytes of alignment slack + 128
// bytes for the 2 x STAGES mbarriers; the FP8 kernels add 2 raw slices of BN x 64 bytes.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace {
constexpr int GG_BM = GROUPED_TILE_M_SM90, GG_BK = 64;
// Four stages of A + a 256-row W slice (or six of a 128-row one), the alignment slack, the ring's
// mbarriers: what the Rust wrapper asks for (dims.cuh).
static_assert(4 * (GG_BM + 256) * GG_BK * 2 + 1024 + 128 == GROUPED_SM90_SMEM_BYTES &&
                  6 * (GG_BM + 128) * GG_BK * 2 <= 4 * (GG_BM + 256) * GG_BK * 2,
              "wgmma grouped GEMM: dims.cuh's shared-memory size differs from the kernel's layout");
static_assert(GROUPED_SM90_SMEM_BYTES + 2 * 256 * GG_BK == GROUPED_SM90_FP8_SMEM_BYTES,
              "wgmma grouped GEMM: dims.cuh's FP8 shared-memory size differs from the kernel's layout");
}  // namespace

// Block-FP8 weights in the producer. Thread tid's chunks of a K slice are 8 bytes (8 weights) of
// rows r0 + 16 i (i < WI; with SILU also the up rows N further on), as for bf16; raw slot entry
// (half * WI + i) * 128 + tid holds one. FP8_RAW_SLOTS slices of the ring are in flight.
constexpr int FP8_RAW_SLOTS = 2;

DEVICE_INLINE void cp_async_8s(uint32_t saddr, const void* gmem, bool valid) {
    const int n = valid ? 8 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(saddr), "l"(gmem), "r"(n));
}

// Copies this thread's chunks of a slice (q: its chunk of row r0) into a raw slot (raw: its entry
// 0), zero-filling rows at or past w_left and, with !kok, chunks past K (reading nothing: `any` is
// a valid address to name instead).
template <bool SILU, int WI>
DEVICE_INLINE void fp8_raw_copy(const uint8_t* __restrict__ q, const void* any, uint32_t raw, bool kok, int w_left,
                                int N, int K) {
    // One running pointer behind an empty asm, as for the bf16 copies (few producer registers).
    const uint8_t* p = q;
#pragma unroll
    for (int half = 0; half < (SILU ? 2 : 1); ++half) {
        if (half) {
            p += (size_t)(N - 16 * WI) * K;  // from the gate rows' end to the up rows
            asm volatile("" : "+l"(p));
        }
#pragma unroll
        for (int i = 0; i < WI; ++i) {
            const bool ok = kok && 16 * i < w_left;
            cp_async_8s(raw + (half * WI + i) * 128 * 8, ok ? p : any, ok);
            p += (size_t)16 * K;
            asm volatile("" : "+l"(p));
        }
    }
}

// Dequantizes this thread's chunks of a raw slot into the stage's swizzled weight rows (sB: its
// 16 bytes of row r0) as bf16(float(e4m3) * scale): scale[half] with SILU (gate and up rows each
// within one 128-row block), else scale[16 i / 128].
template <bool SILU, int WI>
DEVICE_INLINE void fp8_raw_dequant(uint32_t raw, uint32_t sB, const float (&scale)[2]) {
#pragma unroll
    for (int half = 0; half < (SILU ? 2 : 1); ++half)
#pragma unroll
        for (int i = 0; i < WI; ++i) {
            uint2 v8;
            asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n"
                         : "=r"(v8.x), "=r"(v8.y)
                         : "r"(raw + (half * WI + i) * 128 * 8));
            const uint4 v = fp8x8_dequant_bf16(v8, scale[SILU ? half : 16 * i / FP8_SCALE_BLOCK]);
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(sB + (half * WI + i) * 2048), "r"(v.x),
                         "r"(v.y), "r"(v.z), "r"(v.w)
                         : "memory");
        }
}

// W8A8 consumer warpgroup, one item's K loop (128-row items: stages of A [128 x 128] and W
// [128 x 128] e4m3). A stage is one 128-wide scale block of K: its four k32 wgmma go into a
// fresh f32 set `part` and are promoted into `acc` with the row's activation scale times the
// block's weight scale. The f32 adds every 128 of K are what keeps the sum exact enough: FP8
// wgmma accumulates in about 14 bits of mantissa (DeepSeek-V3's report; fp8-mtp.md). Two `part`
// sets alternate, so that stage kt + 1's MMAs run while stage kt is promoted (wait_group 1),
// and a stage goes back to the producer once its MMAs have retired. With SILU, accumulators
// [32, 64) are up rows, scaled by the up block's weight scale.
// as: this thread's first row's activation scale of block 0 (stride a_ld per block), its second
// row's hi_rows further on; ws: the item's (gate) weight scale of block 0 (stride 1), the up
// rows' up_off further on.
struct W8a8Scales {
    float lo, hi, up_lo, up_hi;
};

template <bool SILU>
DEVICE_INLINE W8a8Scales w8a8_scales(const float* as, int hi_rows, const float* ws, int up_off, int kt, int a_ld) {
    const float* a = as + (size_t)kt * a_ld;
    const float a_lo = __ldg(a), a_hi = __ldg(a + hi_rows), w = __ldg(ws + kt);
    const float u = SILU ? __ldg(ws + up_off + kt) : 0.f;
    return W8a8Scales{a_lo * w, a_hi * w, a_lo * u, a_hi * u};
}

// acc += part x scales; accumulator 4j + {0, 1} is row gq of the warp's 16, 4j + {2, 3} row gq + 8.
template <bool SILU>
DEVICE_INLINE void w8a8_promote(float (&acc)[64], const float (&part)[64], const W8a8Scales& s) {
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        const bool hi = i & 2, up = SILU && i >= 32;
        acc[i] = fmaf(part[i], up ? (hi ? s.up_hi : s.up_lo) : (hi ? s.hi : s.lo), acc[i]);
    }
}

// Waits for stage g's operands and issues its four e4m3 wgmma into `part` (one commit group).
template <int STAGES>
DEVICE_INLINE void w8a8_issue(float (&part)[64], uint32_t s_base, uint32_t bars, int g, int wg) {
    constexpr uint32_t A_BYTES = GG_BM * 128, STAGE_BYTES = 2 * A_BYTES;
    const int st = g % STAGES;
    mbar_wait(bars + 8 * st, (g / STAGES) & 1);
    fence_proxy_async();  // the cp.async writes (generic proxy) before wgmma reads them
    const uint32_t sA = s_base + st * STAGE_BYTES, sB = sA + A_BYTES;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const uint64_t da = sw128_desc(sA + wg * 64 * 128 + kk * 32, 16, 1024);
        const uint64_t db = sw128_desc(sB + kk * 32, 16, 1024);
        wgmma_m64n128k32_e4m3_ss(part, da, db, kk > 0);
    }
    wgmma_commit();
}

template <bool SILU, int STAGES>
DEVICE_INLINE void w8a8_item_k_loop(float (&acc)[64], uint32_t s_base, uint32_t bars, int& g, int KT, bool active,
                                    int wg, const float* as, int hi_rows, int a_ld, const float* ws, int up_off) {
    if (!active) {  // no rows in this tile: keep the barrier protocol only
        for (int kt = 0; kt < KT; ++kt, ++g) {
            mbar_wait(bars + 8 * (g % STAGES), (g / STAGES) & 1);
            mbar_arrive(bars + 8 * (STAGES + g % STAGES));
        }
        return;
    }
    float p0[64], p1[64];
    // Stage kt's MMAs have retired: hand the stage back, then promote.
    auto retire = [&](float (&part)[64], int kt, const W8a8Scales& sc) {
        reg_fence(part);
        mbar_arrive(bars + 8 * (STAGES + (g + kt) % STAGES));
        w8a8_promote<SILU>(acc, part, sc);
    };
    // Unrolled by two so that each set's issue and reads sit at fixed places: p0 holds the even
    // stages, p1 the odd ones. A stage's scales are loaded right after the previous stage's
    // promotion (one set live at a time: the SiLU kernel is at its register limit) and are
    // needed only a stage of MMAs later.
    auto scales = [&](int kt) { return w8a8_scales<SILU>(as, hi_rows, ws, up_off, kt, a_ld); };
    W8a8Scales sc = scales(0);
    w8a8_issue<STAGES>(p0, s_base, bars, g, wg);
    int kt = 1;
    for (; kt + 1 < KT; kt += 2) {
        w8a8_issue<STAGES>(p1, s_base, bars, g + kt, wg);
        wgmma_wait<1>();
        retire(p0, kt - 1, sc);
        sc = scales(kt);
        w8a8_issue<STAGES>(p0, s_base, bars, g + kt + 1, wg);
        wgmma_wait<1>();
        retire(p1, kt, sc);
        sc = scales(kt + 1);
    }
    if (kt < KT) {  // an even number of stages: the last one is odd
        w8a8_issue<STAGES>(p1, s_base, bars, g + kt, wg);
        wgmma_wait<1>();
        retire(p0, kt - 1, sc);
        sc = scales(kt);
        wgmma_wait<0>();
        retire(p1, kt, sc);
    } else {
        wgmma_wait<0>();
        retire(p0, kt - 1, sc);
    }
    g += KT;
}

// SILU == false: W is [E, N, K], C is [rows, N], item columns n0 = BN · column block.
// SILU == true:  W is [E, 2N, K] (gate rows then up rows), C is [rows, N] = act, n0 = BN/2 · block.
// WT = bf16, or uint8_t for block-FP8 weights with scale_inv (unused for bf16). AT = bf16, or
// uint8_t for W8A8: e4m3 activations [rows, K] with a_scales[g * a_scale_ld + row] per row and
// 128 columns (fp8_quantize_act's layout), FP8 weights, BN = 128.
template <bool SILU, int BN, typename AT, typename WT>
DEVICE_INLINE void grouped_gemm_ws_sm90(const AT* __restrict__ A, const float* __restrict__ a_scales, int a_scale_ld,
                                        const WT* __restrict__ W, const float* __restrict__ scale_inv,
                                        bf16* __restrict__ C, int N, int K, const int* __restrict__ tile_expert,
                                        const int* __restrict__ tile_row0, const int* __restrict__ tile_rows,
                                        const int* __restrict__ num_tiles) {
    constexpr bool FP8 = sizeof(WT) == 1, W8A8 = sizeof(AT) == 1;
    static_assert(!W8A8 || (FP8 && BN == 128), "W8A8 takes FP8 weights in 128-row items");
    // The producer dequantizes FP8 weights into bf16 stages (W8A16); W8A8 copies them as they are.
    constexpr bool DEQUANT = FP8 && !W8A8;
    constexpr int STAGES = BN == 256 ? 4 : 6, NACC = BN / 2;
    constexpr int COLS = SILU ? BN / 2 : BN;
    // A stage row is one 128-byte swizzle row either way: 64 bf16 or 128 e4m3 values of K (one
    // scale block per stage with W8A8), copied in 16-byte chunks of CH values.
    constexpr int BK = 128 / sizeof(AT), CH = 16 / sizeof(AT);
    constexpr uint32_t A_BYTES = GG_BM * GG_BK * 2, STAGE_BYTES = (GG_BM + BN) * GG_BK * 2;
    const int col_blocks = (N + COLS - 1) / COLS;
    const int items = num_tiles[0] * col_blocks;
    const int my_items = blockIdx.x < items ? (items - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    if (my_items == 0) return;
    const int KT = (K + BK - 1) / BK;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t s_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    // full[s] at bars + 8 s (one noinc arrival per producer thread), empty[s] at bars + 8 (STAGES + s)
    // (one arrival per consumer thread).
    const uint32_t bars = s_base + STAGES * STAGE_BYTES;
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bars + 8 * s, DEQUANT ? 256 : 128);
            mbar_init(bars + 8 * (STAGES + s), 256);
        }
    }
    __syncthreads();
    const int w_rows = SILU ? 2 * N : N;
    // FP8: each expert's scale grid, [ceil(w_rows / 128), ceil(K / 128)].
    const int s_rows = (w_rows + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK,
              s_cols = (K + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
    struct Item {
        int e, row0, rows, n0;
    };
    auto item_of = [&](int j) {
        const int it = blockIdx.x + j * gridDim.x, tile = it / col_blocks;
        return Item{tile_expert[tile], tile_row0[tile], tile_rows[tile], (it - tile * col_blocks) * COLS};
    };
    const int role = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (role == 0) {
        set_max_regs_dec<40>();
        // Thread t copies 16-byte chunk t % 8 of rows t / 8 + 16 i (the same swizzle for every i).
        // The row pointers advance one after another behind an empty asm, so that ptxas keeps
        // one running pointer per operand instead of hoisting 24 (the producer has 40 registers).
        const int ch = tid & 7, r0 = tid >> 3;
        const uint32_t soff = r0 * 128 + ((ch ^ (r0 & 7)) << 4);
        // FP8: this thread's entry of raw slot 0 (the ring follows the mbarriers).
        constexpr uint32_t raw_bytes = BN * GG_BK;
        const uint32_t raw_base = bars + 128 + tid * 8;
        const size_t step = (size_t)16 * K;
        for (int turn = 0, g = 0; turn < my_items; ++turn) {
            const Item li = item_of(turn);
            // Rows r0 + 16 i of A exist for 16 i < a_left; weight rows for 16 i < w_left.
            const int a_left = li.rows - r0, w_left = N - li.n0 - r0;
            const AT* a_row = A + (size_t)(li.row0 + r0) * K + ch * CH;
            const WT* w_row = W + ((size_t)li.e * w_rows + li.n0 + r0) * K + ch * CH;
            // SILU: gate rows for i < BN / 32, then the matching up rows N rows further on.
            constexpr int WI = SILU ? BN / 32 : BN / 16;
            // FP8: the scales of the item's first 128-row block (n0 is a multiple of 128, or of
            // 64 with SILU and BN = 128, whose items then stay inside one block), the two a slice's
            // chunks need (gate and up with SILU, N % 128 == 0; else the item's first two blocks,
            // the second only where it has rows), and the raw slice ring, slice kt + 1 in flight
            // while slice kt is dequantized (each thread reads back only its own copies).
            const float* s_item =
                DEQUANT ? scale_inv + ((size_t)li.e * s_rows + li.n0 / FP8_SCALE_BLOCK) * s_cols : nullptr;
            auto fp8_scales = [&](int kt, float (&s)[2]) {
                const float* c = s_item + kt * GG_BK / FP8_SCALE_BLOCK;
                s[0] = __ldg(c);
                if (SILU)
                    s[1] = __ldg(c + (size_t)(N / FP8_SCALE_BLOCK) * s_cols);
                else
                    s[1] = BN > FP8_SCALE_BLOCK && li.n0 + FP8_SCALE_BLOCK < N ? __ldg(c + s_cols) : 0.f;
            };
            auto fp8_copy = [&](int kt, int slice) {
                fp8_raw_copy<SILU, WI>(reinterpret_cast<const uint8_t*>(w_row) + kt * GG_BK, W,
                                       raw_base + (slice % FP8_RAW_SLOTS) * raw_bytes, kt * GG_BK + ch * 8 < K, w_left,
                                       N, K);
            };
            float s_next[2] = {0.f, 0.f};
            if constexpr (DEQUANT) {
                fp8_copy(0, g);
                cp_async_commit();
                fp8_scales(0, s_next);
            }
            for (int kt = 0; kt < KT; ++kt, ++g) {
                const int st = g % STAGES, fill = g / STAGES;
                float s_cur[2] = {s_next[0], s_next[1]};
                if constexpr (DEQUANT)
                    if (kt + 1 < KT) {
                        fp8_copy(kt + 1, g + 1);
                        fp8_scales(kt + 1, s_next);
                    }
                if (fill > 0) mbar_wait(bars + 8 * (STAGES + st), (fill + 1) & 1);
                const bool kok = kt * BK + ch * CH < K;
                const uint32_t sA = s_base + st * STAGE_BYTES + soff, sB = sA + A_BYTES;
                const AT* p = a_row + kt * BK;
#pragma unroll
                for (int i = 0; i < GG_BM / 16; ++i) {
                    const bool ok = kok && 16 * i < a_left;
                    cp_async_16s(sA + i * 2048, ok ? p : A, ok);
                    p += step;
                    asm volatile("" : "+l"(p));
                }
                if constexpr (DEQUANT) {
                    cp_async_arrive_noinc(bars + 8 * st);  // the A copies (and the raw ones before them)
                    cp_async_commit();
                    cp_async_wait<1>();  // all but this slice's group: raw slice kt has landed
                    fp8_raw_dequant<SILU, WI>(raw_base + (g % FP8_RAW_SLOTS) * raw_bytes, sB, s_cur);
                    fence_proxy_async();  // the st.shared writes (generic proxy) before wgmma reads them
                    mbar_arrive(bars + 8 * st);
                } else {
#pragma unroll
                    for (int half = 0; half < (SILU ? 2 : 1); ++half) {
                        const WT* q = w_row + kt * BK + (half ? (size_t)N * K : 0);
#pragma unroll
                        for (int i = 0; i < WI; ++i) {
                            const bool ok = kok && 16 * i < w_left;
                            cp_async_16s(sB + (half * WI + i) * 2048, ok ? q : W, ok);
                            q += step;
                            asm volatile("" : "+l"(q));
                        }
                    }
                    cp_async_arrive_noinc(bars + 8 * st);
                }
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
    } else {
        set_max_regs_inc<232>();
        const int wg = role - 1, ctid = tid - 128;
        const int lane = ctid & 31, warp = (ctid >> 5) & 3, gq = lane >> 2, t4 = lane & 3;
        float acc[NACC];
        for (int turn = 0, g = 0; turn < my_items; ++turn) {
            const Item ci = item_of(turn);
            // A warpgroup with no rows in this tile skips its MMAs but keeps the barrier protocol.
            const bool active = __shfl_sync(0xffffffffu, wg * 64 < ci.rows, 0);
#pragma unroll
            for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
            if constexpr (W8A8) {
                // Rows past the tile read its last row's scales (their results are never stored).
                const int r_lo = min(wg * 64 + warp * 16 + gq, ci.rows - 1);
                const int r_hi = min(wg * 64 + warp * 16 + gq + 8, ci.rows - 1);
                w8a8_item_k_loop<SILU, STAGES>(acc, s_base, bars, g, KT, active, wg, a_scales + ci.row0 + r_lo,
                                               r_hi - r_lo, a_scale_ld,
                                               scale_inv + ((size_t)ci.e * s_rows + ci.n0 / FP8_SCALE_BLOCK) * s_cols,
                                               SILU ? N / FP8_SCALE_BLOCK * s_cols : 0);
            } else {
                for (int kt = 0; kt < KT; ++kt, ++g) {
                    const int st = g % STAGES;
                    mbar_wait(bars + 8 * st, (g / STAGES) & 1);
                    if (active) {
                        fence_proxy_async();  // the cp.async writes (generic proxy) before wgmma reads them
                        const uint32_t sA = s_base + st * STAGE_BYTES, sB = sA + A_BYTES;
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
                    // Slice g - 1's wgmma has retired: its stage goes back to the producer.
                    if (kt > 0) mbar_arrive(bars + 8 * (STAGES + (g - 1) % STAGES));
                }
                wgmma_wait<0>();
                reg_fence(acc);
                mbar_arrive(bars + 8 * (STAGES + (g - 1) % STAGES));
            }
            if (!active) continue;
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
                            *reinterpret_cast<uint32_t*>(dst + j * 8) =
                                pack_bf16(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
                }
            }
        }
    }
}
#endif

#define GROUPED_GEMM_SM90_ARGS                                                                                     \
    const bf16 *__restrict__ A, const bf16 *__restrict__ W, bf16 *__restrict__ C, int N, int K,                    \
        const int *__restrict__ tile_expert, const int *__restrict__ tile_row0, const int *__restrict__ tile_rows, \
        const int *__restrict__ num_tiles
#define GROUPED_GEMM_SM90_FP8_ARGS                                                                                  \
    const bf16 *__restrict__ A, const uint8_t *__restrict__ W, const float *__restrict__ scale_inv,                 \
        bf16 *__restrict__ C, int N, int K, const int *__restrict__ tile_expert, const int *__restrict__ tile_row0, \
        const int *__restrict__ tile_rows, const int *__restrict__ num_tiles
#define GROUPED_GEMM_SM90_W8A8_ARGS                                                                                   \
    const uint8_t *__restrict__ A, const float *__restrict__ a_scales, int a_scale_ld, const uint8_t *__restrict__ W, \
        const float *__restrict__ scale_inv, bf16 *__restrict__ C, int N, int K, const int *__restrict__ tile_expert, \
        const int *__restrict__ tile_row0, const int *__restrict__ tile_rows, const int *__restrict__ num_tiles

// Grid: one block per SM (persistent) or per worst-case item, 384 threads. C = A · W[e]ᵀ (N output columns per
// row), or with _silu act = silu(A · gateᵀ) · (A · upᵀ), W = [E, 2N, K]. _n128: items of 128 weight rows. _fp8:
// block-FP8 weights. _w8a8: block-FP8 weights and e4m3 activations with per-row, per-128-column scales.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GG_BODY(SILU, BN, AT, WT, A_SCALES, A_LD, SCALES)                                                            \
    grouped_gemm_ws_sm90<SILU, BN, AT, WT>(A, A_SCALES, A_LD, W, SCALES, C, N, K, tile_expert, tile_row0, tile_rows, \
                                           num_tiles)
#else
#define GG_BODY(SILU, BN, AT, WT, A_SCALES, A_LD, SCALES)
#endif
#define GG_KERNEL(NAME, SILU, BN, ARGS, AT, WT, A_SCALES, A_LD, SCALES)                \
    extern "C" __global__ void __launch_bounds__(GROUPED_SM90_THREADS, 1) NAME(ARGS) { \
        PDL_ENTRY();                                                                   \
        GG_BODY(SILU, BN, AT, WT, A_SCALES, A_LD, SCALES);                             \
    }
#define GG_KERNEL_BF16(NAME, SILU, BN) \
    GG_KERNEL(NAME, SILU, BN, GROUPED_GEMM_SM90_ARGS, bf16, bf16, nullptr, 0, nullptr)
#define GG_KERNEL_FP8(NAME, SILU, BN) \
    GG_KERNEL(NAME, SILU, BN, GROUPED_GEMM_SM90_FP8_ARGS, bf16, uint8_t, nullptr, 0, scale_inv)
#define GG_KERNEL_W8A8(NAME, SILU) \
    GG_KERNEL(NAME, SILU, 128, GROUPED_GEMM_SM90_W8A8_ARGS, uint8_t, uint8_t, a_scales, a_scale_ld, scale_inv)
GG_KERNEL_BF16(moe_grouped_gemm_sm90, false, 256)
GG_KERNEL_BF16(moe_grouped_gemm_silu_sm90, true, 256)
GG_KERNEL_BF16(moe_grouped_gemm_sm90_n128, false, 128)
GG_KERNEL_BF16(moe_grouped_gemm_silu_sm90_n128, true, 128)
GG_KERNEL_FP8(moe_grouped_gemm_sm90_fp8, false, 256)
GG_KERNEL_FP8(moe_grouped_gemm_silu_sm90_fp8, true, 256)
GG_KERNEL_FP8(moe_grouped_gemm_sm90_n128_fp8, false, 128)
GG_KERNEL_FP8(moe_grouped_gemm_silu_sm90_n128_fp8, true, 128)
// ptxas reports a 4-byte spill in the SiLU one: 192 accumulator registers (acc and the two
// partial sets) leave one value that the epilogue needs spilled across the K loop (without the
// epilogue there is none), reloaded once per item.
GG_KERNEL_W8A8(moe_grouped_gemm_sm90_n128_w8a8, false)
GG_KERNEL_W8A8(moe_grouped_gemm_silu_sm90_n128_w8a8, true)
