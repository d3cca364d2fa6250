// Prefill attention on the normal (decompressed) MLA path: causal flash attention with online
// softmax over variable-length sequences, qk head dim 192 = k_nope 128 + k_pe 64, v head dim 128,
// bf16 tensor cores (mma.sync m16n8k16) with f32 accumulation.
//
// K is never materialised per head: k_nope and v come from the kv_b_proj output [keys, H, 256]
// (per head k_nope | v) and the shared k_pe from the gathered latent rows. Keys are given per
// sequence as a window of absolute positions, so a prompt chunk can attend to a cached prefix,
// and a long context can be processed in several passes whose running (o, m, l) state is kept in
// f32 between launches.
#include "common.cuh"

namespace {
constexpr int PE = ROPE, DQK = NOPE + PE, DV = V_HEAD;
constexpr int BM = 64, BN = 64, NWARPS = 4, NTHREADS = NWARPS * 32;
constexpr int QK_STRIDE = DQK + 8;  // +16 bytes per row: conflict-free 32-bit fragment loads
constexpr int V_STRIDE = DV + 8;
constexpr int KSTEPS = DQK / 16;  // 12
constexpr int S_NTILES = BN / 8;  // 8
constexpr int O_NTILES = DV / 8;  // 16
static_assert((BM * QK_STRIDE + 2 * BN * QK_STRIDE + 2 * BN * V_STRIDE) * 2 == PREFILL_SMEM_BYTES,
              "prefill attention: dims.cuh's shared-memory size differs from the kernel's layout");
static_assert(2 * BM == PREFILL_TILE_Q, "two blocks of this kernel cover one tile-map entry");
}  // namespace

// Dynamic shared memory (the Rust wrapper computes the same): (BM * QK_STRIDE + 2 * BN * QK_STRIDE + 2 * BN * V_STRIDE) * 2

enum : int { PASS_LOAD_STATE = 1, PASS_FINAL = 2 };

extern "C" __global__ void __launch_bounds__(NTHREADS)
    mla_prefill_attention(const bf16* __restrict__ q, int q_stride,    // [Tq, H * 192], per head [q_nope | q_pe(roped)]
                          const bf16* __restrict__ kv, int kv_stride,  // [Tk, H * 256], per head [k_nope | v]
                          const bf16* __restrict__ kpe, int kpe_stride,  // [Tk, 64] (latent rows offset to k_pe)
                          bf16* __restrict__ out, int out_stride,        // [Tq, H * 128]
                          float* __restrict__ state_o,                   // [Tq, H, 128] running output (multi-pass)
                          float* __restrict__ state_ml,                  // [Tq, H, 2] running max (log2 units) and sum
                          const int* __restrict__ tile_seq, const int* __restrict__ tile_q0,
                          const int* __restrict__ cu_q,    // [S + 1] query row offsets
                          const int* __restrict__ q_pos0,  // [S] absolute position of each first query
                          const int* __restrict__ k_row0,  // [S] row of the window's first key in kv/kpe
                          const int* __restrict__ k_pos0,  // [S] absolute position of that key
                          const int* __restrict__ k_len,   // [S] keys in this pass's window
                          int heads, float scale_log2, int flags) {
    PDL_ENTRY();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
    bf16* Ks = Qs + BM * QK_STRIDE;      // 2 stages
    bf16* Vs = Ks + 2 * BN * QK_STRIDE;  // 2 stages

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    // Each tile-map entry covers 128 query rows (the wgmma kernel's block); this kernel takes them
    // as two blocks of 64.
    const int tile = blockIdx.x >> 1, h = blockIdx.y;
    const int s = tile_seq[tile], q0 = tile_q0[tile] + BM * (blockIdx.x & 1);
    const int q_begin = cu_q[s], q_len = cu_q[s + 1] - q_begin;
    const int rows = min(BM, q_len - q0);
    if (rows <= 0) return;           // the second half of a short tile
    const int qp0 = q_pos0[s] + q0;  // absolute position of the tile's first query
    const int kr0 = k_row0[s], kp0 = k_pos0[s], klen = k_len[s];
    // Causal: the tile's last query sees keys up to its own position.
    const int n_keys = max(0, min(klen, qp0 + rows - 1 - kp0 + 1));
    const int n_tiles = (n_keys + BN - 1) / BN;

    auto load_q = [&]() {
        for (int c = tid; c < BM * (DQK / 8); c += NTHREADS) {
            const int r = c / (DQK / 8), d = (c % (DQK / 8)) * 8;
            const bool ok = r < rows;
            const bf16* src = q + (size_t)(q_begin + q0 + (ok ? r : 0)) * q_stride + h * DQK + d;
            cp_async_16(Qs + r * QK_STRIDE + d, src, ok);
        }
    };
    auto load_kv = [&](int kt, int stage) {
        bf16* K = Ks + stage * BN * QK_STRIDE;
        bf16* V = Vs + stage * BN * V_STRIDE;
        for (int c = tid; c < BN * (DQK / 8); c += NTHREADS) {
            const int r = c / (DQK / 8), d = (c % (DQK / 8)) * 8;
            const int key = kt * BN + r;
            const bool ok = key < n_keys;
            const size_t row = (size_t)(kr0 + (ok ? key : 0));
            const bf16* src =
                d < NOPE ? kv + row * kv_stride + h * (NOPE + DV) + d : kpe + row * kpe_stride + (d - NOPE);
            cp_async_16(K + r * QK_STRIDE + d, src, ok);
        }
        for (int c = tid; c < BN * (DV / 8); c += NTHREADS) {
            const int r = c / (DV / 8), d = (c % (DV / 8)) * 8;
            const int key = kt * BN + r;
            const bool ok = key < n_keys;
            const size_t row = (size_t)(kr0 + (ok ? key : 0));
            cp_async_16(V + r * V_STRIDE + d, kv + row * kv_stride + h * (NOPE + DV) + NOPE + d, ok);
        }
    };

    // Running state for rows r0 = 16*warp + g and r1 = r0 + 8.
    float o[O_NTILES][4];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const int r_loc[2] = {warp * 16 + g, warp * 16 + g + 8};
#pragma unroll
    for (int n = 0; n < O_NTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    if (flags & PASS_LOAD_STATE) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (r_loc[i] < rows) {
                const size_t row = (size_t)(q_begin + q0 + r_loc[i]) * heads + h;
                m[i] = state_ml[row * 2];
                l[i] = t4 == 0 ? state_ml[row * 2 + 1] : 0.f;  // summed over the quad at the end
#pragma unroll
                for (int n = 0; n < O_NTILES; ++n) {
                    o[n][2 * i] = state_o[row * DV + n * 8 + 2 * t4];
                    o[n][2 * i + 1] = state_o[row * DV + n * 8 + 2 * t4 + 1];
                }
            }
        }
    }

    load_q();
    if (n_tiles > 0) load_kv(0, 0);
    cp_async_commit();

    uint32_t qa[KSTEPS][4];
    for (int kt = 0; kt < n_tiles; ++kt) {
        if (kt + 1 < n_tiles) {
            load_kv(kt + 1, (kt + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (kt == 0) {
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                const bf16* q_lo = Qs + r_loc[0] * QK_STRIDE + ks * 16 + 2 * t4;
                const bf16* q_hi = Qs + r_loc[1] * QK_STRIDE + ks * 16 + 2 * t4;
                qa[ks][0] = lds32(q_lo);
                qa[ks][1] = lds32(q_hi);
                qa[ks][2] = lds32(q_lo + 8);
                qa[ks][3] = lds32(q_hi + 8);
            }
        }
        const bf16* K = Ks + (kt & 1) * BN * QK_STRIDE;
        const bf16* V = Vs + (kt & 1) * BN * V_STRIDE;

        float sc[S_NTILES][4];
#pragma unroll
        for (int n = 0; n < S_NTILES; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
            for (int n = 0; n < S_NTILES; ++n) {
                const bf16* kr = K + (n * 8 + g) * QK_STRIDE + ks * 16 + 2 * t4;
                mma_bf16_16816(sc[n], qa[ks], lds32(kr), lds32(kr + 8));
            }
        }

        // Mask (causal + window end), scale, online softmax.
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < S_NTILES; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1;
                const int key = kt * BN + n * 8 + 2 * t4 + (e & 1);
                const int qpos = qp0 + r_loc[i];
                const bool ok = key < n_keys && kp0 + key <= qpos;
                sc[n][e] = ok ? sc[n][e] * scale_log2 : -INFINITY;
                tile_max[i] = fmaxf(tile_max[i], sc[n][e]);
            }
        }
        float alpha[2], m_use[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            tile_max[i] = quad_max(tile_max[i]);
            const float m_new = fmaxf(m[i], tile_max[i]);
            m_use[i] = m_new == -INFINITY ? 0.f : m_new;  // a fully masked row so far stays at zero
            alpha[i] = exp2f(m[i] - m_use[i]);
            m[i] = m_new;
            l[i] *= alpha[i];
        }
#pragma unroll
        for (int n = 0; n < O_NTILES; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
#pragma unroll
        for (int n = 0; n < S_NTILES; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1;
                sc[n][e] = exp2f(sc[n][e] - m_use[i]);
                l[i] += sc[n][e];
            }
        }

        // O += P V: the S accumulators of two adjacent key tiles form one A fragment.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t pa[4];
            pa[0] = pack_bf16(sc[2 * kk][0], sc[2 * kk][1]);
            pa[1] = pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
            pa[2] = pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[3] = pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
            const int mi = lane >> 3, ri = lane & 7;
#pragma unroll
            for (int vn = 0; vn < O_NTILES / 2; ++vn) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, V + (kk * 16 + ri + (mi & 1) * 8) * V_STRIDE + vn * 16 + (mi >> 1) * 8);
                mma_bf16_16816(o[2 * vn], pa, b[0], b[1]);
                mma_bf16_16816(o[2 * vn + 1], pa, b[2], b[3]);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] = quad_sum(l[i]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (r_loc[i] >= rows) continue;
        const size_t tok = (size_t)(q_begin + q0 + r_loc[i]);
        if (flags & PASS_FINAL) {
            const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
            bf16* dst = out + tok * out_stride + h * DV;
#pragma unroll
            for (int n = 0; n < O_NTILES; ++n)
                *reinterpret_cast<uint32_t*>(dst + n * 8 + 2 * t4) =
                    pack_bf16(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
        } else {
            const size_t row = tok * heads + h;
#pragma unroll
            for (int n = 0; n < O_NTILES; ++n) {
                state_o[row * DV + n * 8 + 2 * t4] = o[n][2 * i];
                state_o[row * DV + n * 8 + 2 * t4 + 1] = o[n][2 * i + 1];
            }
            if (t4 == 0) {
                state_ml[row * 2] = m[i];
                state_ml[row * 2 + 1] = l[i];
            }
        }
    }
}
