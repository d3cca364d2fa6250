// Prefill attention for Hopper (sm_90a): the same function as mla_prefill_attention in
// attention_prefill.cu (causal flash attention over variable-length sequences, qk 192 = k_nope 128 +
// shared k_pe 64, v 128, key windows with an f32 (o, m, l) state between passes), on warpgroup MMA.
//
// One block = 128 query rows of one head, two warpgroups of 64 rows each that load and compute in
// lockstep: all 256 threads copy Q once and K/V tiles of 128 keys with cp.async straight into the
// 128-byte-swizzled layout wgmma reads (double-buffered, one block-wide barrier per tile), then each
// warpgroup runs S = Q·Kᵀ (wgmma m64n128k16, both operands in shared memory, K-major), the online
// softmax in log2 units (scale folded into one FMA, masks only on tiles that cross the diagonal or
// the window end) and O += P·V with P from registers and V from shared memory N-major (transposed
// by the descriptor). A warp-specialised version (producer warpgroup, mbarrier pipeline, deferred
// P·V) was slower in every run and was removed after runs 16/D4/F5 (docs/cuda-notes.md).
//
// Shared memory: Q [128 x 192] + 2 stages x (K [128 x 192] + V [128 x 128]) bf16 = 208 KB, each
// operand stored as 64-column blocks of [rows x 128 bytes] with 16-byte chunk j of row r at j ^ (r % 8)
// (the 128-byte swizzle), every block 1024-byte aligned.
#include "wgmma.cuh"

// Dynamic shared memory (the Rust wrapper computes the same): Q_BYTES + 2 * STAGE_BYTES + 2048
// (1024-byte alignment slack; the other 1024 held the mbarriers of the removed warp-specialised
// kernel and stay so that the launch is unchanged) = 215040 bytes.

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
    PDL_ENTRY();
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
