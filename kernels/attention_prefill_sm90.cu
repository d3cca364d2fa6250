// Prefill attention for Hopper (sm_90a): the same function as mla_prefill_attention in
// attention_prefill.cu (causal flash attention over variable-length sequences, qk 192 = k_nope 128 +
// shared k_pe 64, v 128, key windows with an f32 (o, m, l) state between passes), on warpgroup MMA.
//
// One block = 128 query rows of one head, warp-specialised: a producer warpgroup copies Q once and
// K/V tiles of 128 keys with cp.async straight into the 128-byte-swizzled layout wgmma reads
// (double-buffered, full/empty mbarriers per stage), and two consumer warpgroups of 64 rows each run
// independently of each other, so one's softmax overlaps the other's MMAs. S = Q·Kᵀ is wgmma
// m64n128k16 with both operands in shared memory (K-major); O += P·V takes P from registers (the S
// accumulators rounded to bf16 already sit in the A-fragment layout) and V from shared memory
// N-major (transposed by the descriptor), so nothing is stored back to shared memory. Softmax in
// log2 units with the scale folded into one FMA; masks only on tiles that cross the diagonal or the
// window end; tiles wholly above the diagonal for a warpgroup skip its MMAs. setmaxnreg moves
// registers from the producer (56) to the consumers (224).
//
// Shared memory: Q [128 x 192] + 2 stages x (K [128 x 192] + V [128 x 128]) bf16 = 208 KB, each
// operand stored as 64-column blocks of [rows x 128 bytes] with 16-byte chunk j of row r at j ^ (r % 8)
// (the 128-byte swizzle), every block 1024-byte aligned.
#include "wgmma.cuh"

namespace {
constexpr int NTHREADS = 384;  // producer warpgroup + 2 consumer warpgroups
}  // namespace

// Dynamic shared memory (the Rust wrapper computes the same): Q_BYTES + 2 * STAGE_BYTES + 2048
// (1024-byte alignment slack, then the mbarriers) = 215040 bytes.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// (Only the sm_90a pass uses these; the compute_80 PTX pass builds empty kernels.)
namespace {
constexpr int NOPE = 128, DQK = 192, DV = 128;
constexpr int BM = 128, BN = 128;
constexpr uint32_t Q_BYTES = BM * DQK * 2, K_BYTES = BN * DQK * 2, V_BYTES = BN * DV * 2;
constexpr uint32_t STAGE_BYTES = K_BYTES + V_BYTES;
}  // namespace

// 2^x on the special-function unit alone: exp2f adds range fix-ups (4-5 instructions) that a
// softmax whose arguments are <= 0 (or -inf, giving 0) does not need.
DEVICE_INLINE float ex2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

#endif

enum : int { PASS_LOAD_STATE = 1, PASS_FINAL = 2 };

// Grid: (tiles, heads). The tile map lists the heaviest tiles first, so each head starts with its
// longest tiles, and the blocks in flight together share a few heads' keys and values in L2.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) mla_prefill_attention_sm90(
    const bf16* __restrict__ q, int q_stride,      // [Tq, H * 192], per head [q_nope | q_pe(roped)]
    const bf16* __restrict__ kv, int kv_stride,    // [Tk, H * 256], per head [k_nope | v]
    const bf16* __restrict__ kpe, int kpe_stride,  // [Tk, 64] (latent rows offset to k_pe)
    bf16* __restrict__ out, int out_stride,        // [Tq, H * 128]
    float* __restrict__ state_o,                   // [Tq, H, 128] running output (multi-pass)
    float* __restrict__ state_ml,                  // [Tq, H, 2] running max (log2 units) and sum
    const int* __restrict__ tile_seq, const int* __restrict__ tile_q0,
    const int* __restrict__ cu_q, const int* __restrict__ q_pos0, const int* __restrict__ k_row0,
    const int* __restrict__ k_pos0, const int* __restrict__ k_len, int heads, float scale_log2, int flags) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t s_base = (raw + 1023u) & ~1023u;
    const uint32_t sQ = s_base, sKV = s_base + Q_BYTES;
    // mbarriers after the tiles (at most 1008 bytes of the slack go to the alignment).
    const uint32_t bars = sKV + 2 * STAGE_BYTES;
    const uint32_t bar_q = bars, full_k = bars + 8, full_v = bars + 24, empty_k = bars + 40, empty_v = bars + 56;

    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int tile = blockIdx.x, h = blockIdx.y;
    const int s = tile_seq[tile], q0 = tile_q0[tile];
    const int q_begin = cu_q[s], q_len = cu_q[s + 1] - q_begin;
    const int rows = min(BM, q_len - q0);
    const int qp0 = q_pos0[s] + q0;
    const int kr0 = k_row0[s], kp0 = k_pos0[s], klen = k_len[s];
    const int n_keys = max(0, min(klen, qp0 + rows - kp0));
    const int n_tiles = (n_keys + BN - 1) / BN;

    if (tid == 0) {
        mbar_init(bar_q, 128);
#pragma unroll
        for (int st = 0; st < 2; ++st) {
            mbar_init(full_k + 8 * st, 128);   // one asynchronous arrival per producer thread
            mbar_init(full_v + 8 * st, 128);
            mbar_init(empty_k + 8 * st, 256);  // every consumer thread
            mbar_init(empty_v + 8 * st, 256);
        }
    }
    __syncthreads();

    // The warpgroup index through a shuffle: the compiler then knows it is uniform per warp, and
    // does not serialise the wgmma instructions under branches that depend on it.
    const int wg_idx = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (wg_idx == 0) {
        // Producer warpgroup: cp.async into the swizzled tiles. Each thread's copies signal the
        // stage's full barrier when they land (cp.async.mbarrier.arrive), so the producer never
        // waits for its own copies, only for the consumers to free a stage. K and V have separate
        // barriers: K is freed after S = QKᵀ, V only after the (deferred) P·V.
        set_max_regs_dec<56>();
        const int ptid = tid;
        for (int c = ptid; c < BM * (DQK / 8); c += 128) {
            const int r = c / (DQK / 8), ch = c % (DQK / 8);
            const bool ok = r < rows;
            const bf16* src = q + (size_t)(q_begin + q0 + (ok ? r : 0)) * q_stride + h * DQK + ch * 8;
            cp_async_16s(sQ + sw128_offset(BM, r, ch), src, ok);
        }
        cp_async_arrive_noinc(bar_q);
        for (int kt = 0; kt < n_tiles; ++kt) {
            const int st = kt & 1;
            const uint32_t sK = sKV + st * STAGE_BYTES, sV = sK + K_BYTES;
            if (kt >= 2) mbar_wait(empty_k + 8 * st, ((kt >> 1) + 1) & 1);
#pragma unroll 4
            for (int c = ptid; c < BN * (DQK / 8); c += 128) {
                const int r = c / (DQK / 8), ch = c % (DQK / 8);
                const int key = kt * BN + r;
                const bool ok = key < n_keys;
                const size_t row = (size_t)(kr0 + (ok ? key : 0));
                const bf16* src = ch < NOPE / 8 ? kv + row * kv_stride + h * (NOPE + DV) + ch * 8
                                                : kpe + row * kpe_stride + (ch - NOPE / 8) * 8;
                cp_async_16s(sK + sw128_offset(BN, r, ch), src, ok);
            }
            cp_async_arrive_noinc(full_k + 8 * st);
            if (kt >= 2) mbar_wait(empty_v + 8 * st, ((kt >> 1) + 1) & 1);
#pragma unroll 4
            for (int c = ptid; c < BN * (DV / 8); c += 128) {
                const int r = c / (DV / 8), ch = c % (DV / 8);
                const int key = kt * BN + r;
                const bool ok = key < n_keys;
                const size_t row = (size_t)(kr0 + (ok ? key : 0));
                cp_async_16s(sV + sw128_offset(BN, r, ch), kv + row * kv_stride + h * (NOPE + DV) + NOPE + ch * 8, ok);
            }
            cp_async_arrive_noinc(full_v + 8 * st);
        }
        cp_async_wait<0>();  // nothing in flight when the producer exits
        return;
    }
    set_max_regs_inc<224>();
    // Consumer warpgroups 0 and 1 (threads 128..383): 64 query rows each. Per key tile t the MMA
    // phase issues P(t-1)·V(t-1) and S(t) = Q·K(t)ᵀ together, then softmax(t) runs while the other
    // warpgroup's MMA phase keeps the tensor cores busy (named barriers alternate the phases).
    const int wg = wg_idx - 1, wtid = tid & 127;
    const int wg_rows = min(64, rows - 64 * wg);  // may be <= 0: this warpgroup only releases stages

    // This thread's rows (warpgroup accumulator layout = the m16n8 C layout per warp).
    const int r_loc[2] = {64 * wg + 16 * (wtid >> 5) + g, 64 * wg + 16 * (wtid >> 5) + g + 8};
    float o[64];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    if (flags & PASS_LOAD_STATE) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (r_loc[i] < rows) {
                const size_t row = (size_t)(q_begin + q0 + r_loc[i]) * heads + h;
                m[i] = state_ml[row * 2];
                l[i] = t4 == 0 ? state_ml[row * 2 + 1] : 0.f;  // summed over the quad at the end
#pragma unroll
                for (int n = 0; n < 16; ++n) {
                    o[4 * n + 2 * i] = state_o[row * DV + n * 8 + 2 * t4];
                    o[4 * n + 2 * i + 1] = state_o[row * DV + n * 8 + 2 * t4 + 1];
                }
            }
        }
    }

    // Last absolute query position this warpgroup owns.
    const int wg_last_pos = qp0 + 64 * wg + wg_rows - 1;
    uint32_t pa[8][4];  // P of the previous tile, waiting for its P·V
    float sc[64];

    // The MMA issue of one phase; the wgmma instructions sit outside data-dependent branches so
    // that ptxas keeps them pipelined.
    auto issue_pv = [&](int pst) {
        const uint32_t sV = sKV + pst * STAGE_BYTES + K_BYTES;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
            wgmma_m64n128k16_rs_nmajor(o, pa[kk], sw128_desc(sV + kk * 16 * 128, BN * 128, 1024));
    };
    auto issue_qk = [&](int st) {
        const uint32_t sK = sKV + st * STAGE_BYTES;
#pragma unroll
        for (int ks = 0; ks < DQK / 16; ++ks) {
            const int cb = ks >> 2, kk = ks & 3;
            const uint64_t da = sw128_desc(sQ + cb * BM * 128 + wg * 64 * 128 + kk * 32, 16, 1024);
            const uint64_t db = sw128_desc(sK + cb * BN * 128 + kk * 32, 16, 1024);
            wgmma_m64n128k16_ss(sc, da, db, ks > 0);
        }
    };
    // Online softmax of tile kt from sc into pa (zeros when no key of the tile is visible).
    auto softmax = [&](int kt) {
        if (!(wg_rows > 0 && kp0 + kt * BN <= wg_last_pos)) {
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
            return;
        }
        // Mask only where some key lies past the window end or after this warpgroup's first query.
        const bool need_mask = kt * BN + BN > n_keys || kp0 + kt * BN + BN - 1 > qp0 + 64 * wg;
        if (need_mask) {
#pragma unroll
            for (int n = 0; n < 16; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kt * BN + n * 8 + 2 * t4 + (e & 1);
                    const int qpos = qp0 + r_loc[e >> 1];
                    if (!(key < n_keys && kp0 + key <= qpos)) sc[4 * n + e] = -INFINITY;
                }
            }
        }
        float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            tmax[0] = fmaxf(tmax[0], fmaxf(sc[4 * n], sc[4 * n + 1]));
            tmax[1] = fmaxf(tmax[1], fmaxf(sc[4 * n + 2], sc[4 * n + 3]));
        }
        float alpha[2], m_use[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 1));
            tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 2));
            const float m_new = fmaxf(m[i], tmax[i] * scale_log2);
            m_use[i] = m_new == -INFINITY ? 0.f : m_new;  // a fully masked row so far stays at zero
            alpha[i] = ex2_fast(m[i] - m_use[i]);
            m[i] = m_new;
            l[i] *= alpha[i];
        }
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            o[4 * n] *= alpha[0];
            o[4 * n + 1] *= alpha[0];
            o[4 * n + 2] *= alpha[1];
            o[4 * n + 3] *= alpha[1];
        }
#pragma unroll
        for (int n = 0; n < 16; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1;
                const float p = ex2_fast(fmaf(sc[4 * n + e], scale_log2, -m_use[i]));
                sc[4 * n + e] = p;
                l[i] += p;
            }
        }
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            pa[kk][0] = pack_bf16(sc[8 * kk + 0], sc[8 * kk + 1]);
            pa[kk][1] = pack_bf16(sc[8 * kk + 2], sc[8 * kk + 3]);
            pa[kk][2] = pack_bf16(sc[8 * kk + 4], sc[8 * kk + 5]);
            pa[kk][3] = pack_bf16(sc[8 * kk + 6], sc[8 * kk + 7]);
        }
    };

    mbar_wait(bar_q, 0);
    if (n_tiles > 0) {
        if (wg == 1) named_arrive(1);  // warpgroup 0 issues first
        // Phase 0: S(0) only.
        mbar_wait(full_k, 0);
        fence_proxy_async();  // the cp.async writes (generic proxy) before wgmma reads them
        named_sync(1 + wg);
        wgmma_fence();
        issue_qk(0);
        wgmma_commit();
        named_arrive(2 - wg);  // the other warpgroup's turn
        wgmma_wait<0>();
        reg_fence(sc);
        mbar_arrive(empty_k);
        softmax(0);
        // Phases 1 .. n_tiles - 1: P(t-1)·V(t-1) and S(t) issued together.
        for (int kt = 1; kt < n_tiles; ++kt) {
            const int st = kt & 1, pst = st ^ 1;
            mbar_wait(full_k + 8 * st, (kt >> 1) & 1);
            mbar_wait(full_v + 8 * pst, ((kt - 1) >> 1) & 1);
            fence_proxy_async();
            named_sync(1 + wg);
            wgmma_fence();
            issue_qk(st);  // (this order keeps ptxas from serialising the wgmma chain)
            issue_pv(pst);
            wgmma_commit();
            named_arrive(2 - wg);
            wgmma_wait<0>();
            reg_fence(o);
            reg_fence(sc);
            mbar_arrive(empty_v + 8 * pst);
            mbar_arrive(empty_k + 8 * st);
            softmax(kt);
        }
        // Last phase: P·V of the last tile.
        const int pst = (n_tiles - 1) & 1;
        mbar_wait(full_v + 8 * pst, ((n_tiles - 1) >> 1) & 1);
        fence_proxy_async();
        named_sync(1 + wg);
        wgmma_fence();
        issue_pv(pst);
        wgmma_commit();
        if (wg == 0) named_arrive(2);  // balances warpgroup 1's last wait; 1 sent its first early
        wgmma_wait<0>();
        reg_fence(o);
        mbar_arrive(empty_v + 8 * pst);
    }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (r_loc[i] >= rows) continue;
        const size_t tok = (size_t)(q_begin + q0 + r_loc[i]);
        if (flags & PASS_FINAL) {
            const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
            bf16* dst = out + tok * out_stride + h * DV;
#pragma unroll
            for (int n = 0; n < 16; ++n)
                *reinterpret_cast<uint32_t*>(dst + n * 8 + 2 * t4) = pack_bf16(o[4 * n + 2 * i] * inv, o[4 * n + 2 * i + 1] * inv);
        } else {
            const size_t row = tok * heads + h;
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                state_o[row * DV + n * 8 + 2 * t4] = o[4 * n + 2 * i];
                state_o[row * DV + n * 8 + 2 * t4 + 1] = o[4 * n + 2 * i + 1];
            }
            if (t4 == 0) {
                state_ml[row * 2] = m[i];
                state_ml[row * 2 + 1] = l[i];
            }
        }
    }
#else
    // Built only for sm_90a; the wrapper never launches this elsewhere.
    asm volatile("trap;");
#endif
}

// Variant without warp specialisation (all 256 threads load, then both warpgroups compute, one
// block-wide barrier per tile), kept to measure what the producer/consumer split buys.
extern "C" __global__ void __launch_bounds__(256, 1) mla_prefill_attention_sm90_sync(
    const bf16* __restrict__ q, int q_stride,      // [Tq, H * 192], per head [q_nope | q_pe(roped)]
    const bf16* __restrict__ kv, int kv_stride,    // [Tk, H * 256], per head [k_nope | v]
    const bf16* __restrict__ kpe, int kpe_stride,  // [Tk, 64] (latent rows offset to k_pe)
    bf16* __restrict__ out, int out_stride,        // [Tq, H * 128]
    float* __restrict__ state_o,                   // [Tq, H, 128] running output (multi-pass)
    float* __restrict__ state_ml,                  // [Tq, H, 2] running max (log2 units) and sum
    const int* __restrict__ tile_seq, const int* __restrict__ tile_q0,
    const int* __restrict__ cu_q, const int* __restrict__ q_pos0, const int* __restrict__ k_row0,
    const int* __restrict__ k_pos0, const int* __restrict__ k_len, int heads, float scale_log2, int flags) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t s_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sQ = s_base, sKV = s_base + Q_BYTES;

    const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int tile = blockIdx.x, h = blockIdx.y;
    const int s = tile_seq[tile], q0 = tile_q0[tile];
    const int q_begin = cu_q[s], q_len = cu_q[s + 1] - q_begin;
    const int rows = min(BM, q_len - q0);
    const int wg_rows = min(64, rows - 64 * wg);  // may be <= 0: this warpgroup only loads
    const int qp0 = q_pos0[s] + q0;
    const int kr0 = k_row0[s], kp0 = k_pos0[s], klen = k_len[s];
    const int n_keys = max(0, min(klen, qp0 + rows - kp0));
    const int n_tiles = (n_keys + BN - 1) / BN;

    auto load_q = [&]() {
#pragma unroll 4
        for (int c = tid; c < BM * (DQK / 8); c += 256) {
            const int r = c / (DQK / 8), ch = c % (DQK / 8);
            const bool ok = r < rows;
            const bf16* src = q + (size_t)(q_begin + q0 + (ok ? r : 0)) * q_stride + h * DQK + ch * 8;
            cp_async_16s(sQ + sw128_offset(BM, r, ch), src, ok);
        }
    };
    auto load_kv = [&](int kt, int stage) {
        const uint32_t sK = sKV + stage * STAGE_BYTES, sV = sK + K_BYTES;
#pragma unroll 4
        for (int c = tid; c < BN * (DQK / 8); c += 256) {
            const int r = c / (DQK / 8), ch = c % (DQK / 8);
            const int key = kt * BN + r;
            const bool ok = key < n_keys;
            const size_t row = (size_t)(kr0 + (ok ? key : 0));
            const bf16* src = ch < NOPE / 8 ? kv + row * kv_stride + h * (NOPE + DV) + ch * 8
                                            : kpe + row * kpe_stride + (ch - NOPE / 8) * 8;
            cp_async_16s(sK + sw128_offset(BN, r, ch), src, ok);
        }
#pragma unroll 4
        for (int c = tid; c < BN * (DV / 8); c += 256) {
            const int r = c / (DV / 8), ch = c % (DV / 8);
            const int key = kt * BN + r;
            const bool ok = key < n_keys;
            const size_t row = (size_t)(kr0 + (ok ? key : 0));
            cp_async_16s(sV + sw128_offset(BN, r, ch), kv + row * kv_stride + h * (NOPE + DV) + NOPE + ch * 8, ok);
        }
    };

    // This thread's rows (warpgroup accumulator layout = the m16n8 C layout per warp).
    const int r_loc[2] = {64 * wg + 16 * (wtid >> 5) + g, 64 * wg + 16 * (wtid >> 5) + g + 8};
    float o[64];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    if (flags & PASS_LOAD_STATE) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (r_loc[i] < rows) {
                const size_t row = (size_t)(q_begin + q0 + r_loc[i]) * heads + h;
                m[i] = state_ml[row * 2];
                l[i] = t4 == 0 ? state_ml[row * 2 + 1] : 0.f;  // summed over the quad at the end
#pragma unroll
                for (int n = 0; n < 16; ++n) {
                    o[4 * n + 2 * i] = state_o[row * DV + n * 8 + 2 * t4];
                    o[4 * n + 2 * i + 1] = state_o[row * DV + n * 8 + 2 * t4 + 1];
                }
            }
        }
    }

    load_q();
    if (n_tiles > 0) load_kv(0, 0);
    cp_async_commit();

    // Last absolute query position this warpgroup owns.
    const int wg_last_pos = qp0 + 64 * wg + wg_rows - 1;
    for (int kt = 0; kt < n_tiles; ++kt) {
        if (kt + 1 < n_tiles) {
            load_kv(kt + 1, (kt + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        fence_proxy_async();
        __syncthreads();
        const uint32_t sK = sKV + (kt & 1) * STAGE_BYTES, sV = sK + K_BYTES;
        if (wg_rows > 0 && kp0 + kt * BN <= wg_last_pos) {
            float sc[64];
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < DQK / 16; ++ks) {
                const int cb = ks >> 2, kk = ks & 3;
                const uint64_t da = sw128_desc(sQ + cb * BM * 128 + wg * 64 * 128 + kk * 32, 16, 1024);
                const uint64_t db = sw128_desc(sK + cb * BN * 128 + kk * 32, 16, 1024);
                wgmma_m64n128k16_ss(sc, da, db, ks > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(sc);

            // Mask only where some key lies past the window end or after this warpgroup's first query.
            const bool need_mask = kt * BN + BN > n_keys || kp0 + kt * BN + BN - 1 > qp0 + 64 * wg;
            if (need_mask) {
#pragma unroll
                for (int n = 0; n < 16; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = kt * BN + n * 8 + 2 * t4 + (e & 1);
                        const int qpos = qp0 + r_loc[e >> 1];
                        if (!(key < n_keys && kp0 + key <= qpos)) sc[4 * n + e] = -INFINITY;
                    }
                }
            }
            float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                tmax[0] = fmaxf(tmax[0], fmaxf(sc[4 * n], sc[4 * n + 1]));
                tmax[1] = fmaxf(tmax[1], fmaxf(sc[4 * n + 2], sc[4 * n + 3]));
            }
            float alpha[2], m_use[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 1));
                tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 2));
                const float m_new = fmaxf(m[i], tmax[i] * scale_log2);
                m_use[i] = m_new == -INFINITY ? 0.f : m_new;  // a fully masked row so far stays at zero
                alpha[i] = ex2_fast(m[i] - m_use[i]);
                m[i] = m_new;
                l[i] *= alpha[i];
            }
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                o[4 * n] *= alpha[0];
                o[4 * n + 1] *= alpha[0];
                o[4 * n + 2] *= alpha[1];
                o[4 * n + 3] *= alpha[1];
            }
            uint32_t pa[8][4];
#pragma unroll
            for (int n = 0; n < 16; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = e >> 1;
                    const float p = ex2_fast(fmaf(sc[4 * n + e], scale_log2, -m_use[i]));
                    sc[4 * n + e] = p;
                    l[i] += p;
                }
            }
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                pa[kk][0] = pack_bf16(sc[8 * kk + 0], sc[8 * kk + 1]);
                pa[kk][1] = pack_bf16(sc[8 * kk + 2], sc[8 * kk + 3]);
                pa[kk][2] = pack_bf16(sc[8 * kk + 4], sc[8 * kk + 5]);
                pa[kk][3] = pack_bf16(sc[8 * kk + 6], sc[8 * kk + 7]);
            }
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                const uint64_t db = sw128_desc(sV + kk * 16 * 128, BN * 128, 1024);
                wgmma_m64n128k16_rs_nmajor(o, pa[kk], db);
            }
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(o);
        }
        __syncthreads();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (r_loc[i] >= rows) continue;
        const size_t tok = (size_t)(q_begin + q0 + r_loc[i]);
        if (flags & PASS_FINAL) {
            const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
            bf16* dst = out + tok * out_stride + h * DV;
#pragma unroll
            for (int n = 0; n < 16; ++n)
                *reinterpret_cast<uint32_t*>(dst + n * 8 + 2 * t4) = pack_bf16(o[4 * n + 2 * i] * inv, o[4 * n + 2 * i + 1] * inv);
        } else {
            const size_t row = tok * heads + h;
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                state_o[row * DV + n * 8 + 2 * t4] = o[4 * n + 2 * i];
                state_o[row * DV + n * 8 + 2 * t4 + 1] = o[4 * n + 2 * i + 1];
            }
            if (t4 == 0) {
                state_ml[row * 2] = m[i];
                state_ml[row * 2 + 1] = l[i];
            }
        }
    }
#else
    // Built only for sm_90a; the wrapper never launches this elsewhere.
    asm volatile("trap;");
#endif
}
