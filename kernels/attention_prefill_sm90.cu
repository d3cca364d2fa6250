// Prefill attention for Hopper (sm_90a): the same function as mla_prefill_attention in
// attention_prefill.cu (causal flash attention over variable-length sequences, qk 192 = k_nope 128 +
// shared k_pe 64, v 128, key windows with an f32 (o, m, l) state between passes), on warpgroup MMA.
//
// One block = 128 query rows of one head, 384 threads, warp-specialised like grouped_gemm_sm90.cu:
// - warpgroup 0 (setmaxnreg 40) is the producer: it copies Q once and then, for key tile j, K(j)
//   and V(j - 1) (128 keys each) with cp.async straight into the 128-byte-swizzled layout wgmma
//   reads, each thread signalling the buffer's full mbarrier when its copies land
//   (cp.async.mbarrier.arrive.noinc); K and V have two buffers each and their own full/empty
//   barriers, since K is free after S = Q·Kᵀ and V only after P·V. Every thread copies 16-byte
//   chunk t % 8 of rows t / 8 + 16 i, so its swizzled offset is one constant.
// - warpgroups 1 and 2 (setmaxnreg 232) own 64 query rows each and never meet at a block barrier.
//   Per key tile t a warpgroup issues S(t) = Q·K(t)ᵀ (wgmma m64n128k16, both operands in shared
//   memory, K-major) and O += P(t-1)·V(t-1) (P from registers, V N-major) as two commit groups,
//   waits for S(t) only, runs the online softmax of tile t while P·V is still in the tensor pipe,
//   then waits for P·V, rescales O and packs P(t). Named barriers alternate the two warpgroups'
//   MMA issue (ping-pong), so one's softmax overlaps the other's MMAs as well.
// Softmax in log2 units with the scale folded into one FMA; masks only on tiles that cross the
// diagonal or the window end (a tile with no visible key for a row gives p = 0 and alpha = 1).
// This replaced a lockstep kernel (all 256 threads loading, one block barrier per key tile, each
// warpgroup's softmax with the tensor cores idle): 4x4096 causal 307 -> 604 TFLOP/s on the H200
// (docs/runs/2026-11-22.md, "Prefill attention, warp-specialised").
//
// Shared memory: Q [128 x 192] + 2 x K [128 x 192] + 2 x V [128 x 128] bf16 = 208 KB, each operand
// stored as 64-column blocks of [rows x 128 bytes] with 16-byte chunk j of row r at j ^ (r % 8)
// (the 128-byte swizzle), every block 1024-byte aligned; then 9 mbarriers.
#include "wgmma.cuh"

// Dynamic shared memory (the Rust wrapper computes the same): Q_BYTES + 2 * (K_BYTES + V_BYTES) + 2048
// (1024-byte alignment slack, then the mbarriers) = 215040 bytes.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// (Only the sm_90a pass uses these; the compute_80 PTX pass builds empty kernels.)
namespace {
constexpr int DQK = NOPE + ROPE, DV = V_HEAD;
constexpr int BM = 128, BN = 128;
constexpr uint32_t Q_BYTES = BM * DQK * 2, K_BYTES = BN * DQK * 2, V_BYTES = BN * DV * 2;
static_assert(Q_BYTES + 2 * (K_BYTES + V_BYTES) + 2048 == PREFILL_SM90_SMEM_BYTES,
              "wgmma prefill attention: dims.cuh's shared-memory size differs from the kernel's layout");
static_assert(BM == PREFILL_TILE_Q, "one block of this kernel covers one tile-map entry");
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

// Grid: (tiles, heads), 384 threads. The tile map lists the heaviest tiles first, so each head
// starts with its longest tiles, and the blocks in flight together share a few heads' keys and
// values in L2.
extern "C" __global__ void __launch_bounds__(384, 1)
    mla_prefill_attention_sm90(const bf16* __restrict__ q,
                               int q_stride,  // [Tq, H * 192], per head [q_nope | q_pe(roped)]
                               const bf16* __restrict__ kv, int kv_stride,    // [Tk, H * 256], per head [k_nope | v]
                               const bf16* __restrict__ kpe, int kpe_stride,  // [Tk, 64] (latent rows offset to k_pe)
                               bf16* __restrict__ out, int out_stride,        // [Tq, H * 128]
                               float* __restrict__ state_o,   // [Tq, H, 128] running output (multi-pass)
                               float* __restrict__ state_ml,  // [Tq, H, 2] running max (log2 units) and sum
                               const int* __restrict__ tile_seq, const int* __restrict__ tile_q0,
                               const int* __restrict__ cu_q, const int* __restrict__ q_pos0,
                               const int* __restrict__ k_row0, const int* __restrict__ k_pos0,
                               const int* __restrict__ k_len, int heads, float scale_log2, int flags) {
    PDL_ENTRY();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t s_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sQ = s_base, sK0 = s_base + Q_BYTES, sV0 = sK0 + 2 * K_BYTES;
    // mbarriers after the tiles (at most 1008 bytes of the slack go to the alignment):
    // Q, full K[2], full V[2] (one asynchronous arrival per producer thread), empty K[2], empty V[2]
    // (one arrival per consumer thread).
    const uint32_t bars = sV0 + 2 * V_BYTES;
    const uint32_t bar_q = bars, full_k = bars + 8, full_v = bars + 24, empty_k = bars + 40, empty_v = bars + 56;

    const int tid = threadIdx.x;
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
            mbar_init(full_k + 8 * st, 128);
            mbar_init(full_v + 8 * st, 128);
            mbar_init(empty_k + 8 * st, 256);
            mbar_init(empty_v + 8 * st, 256);
        }
    }
    __syncthreads();

    // The warpgroup index through a shuffle: the compiler then knows it is uniform per warp, and
    // does not serialise the wgmma instructions under branches that depend on it.
    const int role = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (role == 0) {
        set_max_regs_dec<40>();
        const int ch = tid & 7, r0 = tid >> 3;
        const uint32_t soff = r0 * 128 + ((ch ^ (r0 & 7)) << 4);
        {
            const bf16* src = q + (size_t)(q_begin + q0 + r0) * q_stride + h * DQK + ch * 8;
#pragma unroll
            for (int i = 0; i < BM / 16; ++i) {
                const bool ok = r0 + 16 * i < rows;
#pragma unroll
                for (int cb = 0; cb < DQK / 64; ++cb)
                    cp_async_16s(sQ + cb * BM * 128 + i * 2048 + soff, ok ? src + cb * 64 : q, ok);
                src += (size_t)16 * q_stride;
                asm volatile("" : "+l"(src));
            }
            cp_async_arrive_noinc(bar_q);
        }
        const bf16* kv_h = kv + h * (NOPE + DV) + ch * 8;
        const bf16* kpe_c = kpe + ch * 8;
        // Step j copies K(j) (j < n_tiles) and V(j - 1) (j >= 1): S(t) needs K(t), and P·V of tile
        // t - 1 runs next to it.
        for (int j = 0; j <= n_tiles; ++j) {
            if (j < n_tiles) {
                const int st = j & 1;
                if (j >= 2) mbar_wait(empty_k + 8 * st, ((j >> 1) + 1) & 1);
                const uint32_t sK = sK0 + st * K_BYTES + soff;
                const int key0 = j * BN + r0;
#pragma unroll
                for (int i = 0; i < BN / 16; ++i) {
                    const int key = key0 + 16 * i;
                    const bool ok = key < n_keys;
                    const size_t row = (size_t)(kr0 + (ok ? key : 0));
                    const bf16* pk = kv_h + row * kv_stride;
                    const bf16* pp = kpe_c + row * kpe_stride;
                    cp_async_16s(sK + i * 2048, pk, ok);
                    cp_async_16s(sK + BN * 128 + i * 2048, pk + 64, ok);
                    cp_async_16s(sK + 2 * BN * 128 + i * 2048, pp, ok);
                }
                cp_async_arrive_noinc(full_k + 8 * st);
            }
            if (j >= 1) {
                const int t = j - 1, st = t & 1;
                if (t >= 2) mbar_wait(empty_v + 8 * st, ((t >> 1) + 1) & 1);
                const uint32_t sV = sV0 + st * V_BYTES + soff;
                const int key0 = t * BN + r0;
#pragma unroll
                for (int i = 0; i < BN / 16; ++i) {
                    const int key = key0 + 16 * i;
                    const bool ok = key < n_keys;
                    const size_t row = (size_t)(kr0 + (ok ? key : 0));
                    const bf16* pv = kv_h + row * kv_stride + NOPE;
                    cp_async_16s(sV + i * 2048, pv, ok);
                    cp_async_16s(sV + BN * 128 + i * 2048, pv + 64, ok);
                }
                cp_async_arrive_noinc(full_v + 8 * st);
            }
        }
        cp_async_commit();
        cp_async_wait<0>();  // nothing in flight when the producer exits
    } else {
        set_max_regs_inc<232>();
        const int wg = role - 1, wtid = tid & 127, lane = tid & 31, g = lane >> 2, t4 = lane & 3;

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

        uint32_t pa[8][4];  // P of the previous tile, the A operand of its P·V
        float sc[64];
        float alpha[2];

        auto issue_qk = [&](int st) {
            const uint32_t sK = sK0 + st * K_BYTES;
#pragma unroll
            for (int ks = 0; ks < DQK / 16; ++ks) {
                const int cb = ks >> 2, kk = ks & 3;
                const uint64_t da = sw128_desc(sQ + cb * BM * 128 + wg * 64 * 128 + kk * 32, 16, 1024);
                const uint64_t db = sw128_desc(sK + cb * BN * 128 + kk * 32, 16, 1024);
                wgmma_m64n128k16_ss(sc, da, db, ks > 0);
            }
        };
        auto issue_pv = [&](int st) {
            const uint32_t sV = sV0 + st * V_BYTES;
#pragma unroll
            for (int kk = 0; kk < 8; ++kk)
                wgmma_m64n128k16_rs_nmajor(o, pa[kk], sw128_desc(sV + kk * 16 * 128, BN * 128, 1024));
        };
        // Online softmax of tile kt: sc becomes P (f32), m and l move on, alpha is O's rescale
        // (applied by the caller once the P·V in flight has retired).
        auto softmax = [&](int kt) {
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
            float m_use[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                tmax[i] = quad_max(tmax[i]);
                const float m_new = fmaxf(m[i], tmax[i] * scale_log2);
                m_use[i] = m_new == -INFINITY ? 0.f : m_new;  // a fully masked row so far stays at zero
                alpha[i] = ex2_fast(m[i] - m_use[i]);
                m[i] = m_new;
                l[i] *= alpha[i];
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
        };
        auto rescale_pack = [&]() {
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                o[4 * n] *= alpha[0];
                o[4 * n + 1] *= alpha[0];
                o[4 * n + 2] *= alpha[1];
                o[4 * n + 3] *= alpha[1];
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
            rescale_pack();
            // Phases 1 .. n_tiles - 1: S(t) and P(t-1)·V(t-1) issued as two groups; softmax(t)
            // runs while P·V is in flight.
            for (int kt = 1; kt < n_tiles; ++kt) {
                const int st = kt & 1, pst = st ^ 1;
                mbar_wait(full_k + 8 * st, (kt >> 1) & 1);
                mbar_wait(full_v + 8 * pst, ((kt - 1) >> 1) & 1);
                fence_proxy_async();
                named_sync(1 + wg);
                wgmma_fence();
                issue_qk(st);
                wgmma_commit();
                issue_pv(pst);
                wgmma_commit();
                named_arrive(2 - wg);
                wgmma_wait<1>();
                reg_fence(sc);
                mbar_arrive(empty_k + 8 * st);
                softmax(kt);
                wgmma_wait<0>();
                reg_fence(o);
                mbar_arrive(empty_v + 8 * pst);
                rescale_pack();
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
                for (int n = 0; n < 16; ++n)
                    *reinterpret_cast<uint32_t*>(dst + n * 8 + 2 * t4) =
                        pack_bf16(o[4 * n + 2 * i] * inv, o[4 * n + 2 * i + 1] * inv);
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
    }
#else
    // Built only for sm_90a; the wrapper never launches this elsewhere.
    asm volatile("trap;");
#endif
}
