// Decode attention on the absorbed MLA path: MQA with one shared 576-wide key (c_kv 512 | k_pe 64)
// and 512-wide value (c_kv) read straight from the paged latent cache (page = 64 tokens).
//
// One block handles one request, one tile of 16 heads and one split of the request's pages, so
// every page is read once per head tile (once per request for V2-Lite's 16 heads). Splitting the
// KV length over blocks fills the GPU at small batch sizes; the splits are merged by a log-sum-exp
// combine. Everything that varies between steps (lengths, block tables) is read from device
// memory, so a captured CUDA graph stays valid for any contexts at the same batch size.
#include "common.cuh"

namespace {
constexpr int DL = 512, DP = 64, D = DL + DP, PAGE = 64, HT = 16;
constexpr int NWARPS = 4, NTHREADS = NWARPS * 32;
constexpr int KV_STRIDE = D + 8;   // 1168 bytes per row: conflict-free fragment and ldmatrix loads
constexpr int P_STRIDE = PAGE + 8;
constexpr int KSTEPS = D / 16;     // 36
constexpr int DIMS_PER_WARP = DL / NWARPS;  // 128
constexpr int O_NTILES = DIMS_PER_WARP / 8;  // 16
}  // namespace

// Q tile + two KV pages + P tile + reduction scratch + the partial-S exchange.
// Dynamic shared memory (the Rust wrapper computes the same): (HT * KV_STRIDE + 2 * PAGE * KV_STRIDE + HT * P_STRIDE) * 2 + 2 * NWARPS * HT * 4 + NWARPS * 8 * 32 * 16

// QK^T is split over the 576 dims across the warps rather than over the keys: warp w holds Q's
// fragments of k-steps [9w, 9w + 9) in registers for the whole block (no re-reads of Q from shared
// memory per page), computes those dims' partial S for all 64 keys (8 independent chains 9 deep),
// and the partials are summed through shared memory into each warp's 16 keys. This beat one chain
// per key tile over all 576 dims (and the same split into four chains) by 6-9% in run D4; those
// variants were removed after runs D4/F5 (docs/cuda-notes.md).
__device__ __forceinline__ void decode_attention_body(
    const bf16* __restrict__ q, int q_stride,       // [B, H, 576]: q_lat (W_UK^T q_nope) | q_pe (roped)
    const bf16* __restrict__ cache,                 // [blocks * 64, 576]
    const int* __restrict__ block_tables,           // [B, *bt_stride]
    const int* __restrict__ bt_stride_ptr,          // row stride of block_tables (device scalar)
    const int* __restrict__ seq_lens,               // [B] keys per request, the fed token included
    int heads, float scale_log2, int num_splits,
    bf16* __restrict__ out,                         // [B, H, 512] when num_splits == 1
    float* __restrict__ part_o,                     // [B, num_splits, H, 512]
    float* __restrict__ part_lse) {                 // [B, num_splits, H] (log2 units)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
    bf16* KVs = Qs + HT * KV_STRIDE;
    bf16* Ps = KVs + 2 * PAGE * KV_STRIDE;
    float* red_max = reinterpret_cast<float*>(Ps + HT * P_STRIDE);
    float* red_sum = red_max + NWARPS * HT;
    float4* s_part = reinterpret_cast<float4*>(red_sum + NWARPS * HT);  // [NWARPS][8 key tiles][32 lanes]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int split = blockIdx.x, h0 = blockIdx.y * HT, b = blockIdx.z;
    const int len = seq_lens[b];
    const int bt_stride = *bt_stride_ptr;
    const int n_pages = (len + PAGE - 1) / PAGE;
    const int per_split = (n_pages + num_splits - 1) / num_splits;
    const int p_begin = min(n_pages, split * per_split), p_end = min(n_pages, p_begin + per_split);
    const int* table = block_tables + (size_t)b * bt_stride;

    for (int c = tid; c < HT * (D / 8); c += NTHREADS) {
        const int r = c / (D / 8), d = (c % (D / 8)) * 8;
        const bool ok = h0 + r < heads;
        cp_async_16(Qs + r * KV_STRIDE + d, q + (size_t)b * q_stride + (size_t)(h0 + (ok ? r : 0)) * D + d, ok);
    }
    auto load_page = [&](int p, int stage) {
        bf16* dst = KVs + stage * PAGE * KV_STRIDE;
        const size_t base = (size_t)table[p] * PAGE;
        const int valid = min(PAGE, len - p * PAGE);
        for (int c = tid; c < PAGE * (D / 8); c += NTHREADS) {
            const int r = c / (D / 8), d = (c % (D / 8)) * 8;
            const bool ok = r < valid;  // stale rows of the last page may hold anything, even NaN
            cp_async_16(dst + r * KV_STRIDE + d, cache + (base + (ok ? r : 0)) * D + d, ok);
        }
    };
    if (p_begin < p_end) load_page(p_begin, 0);
    cp_async_commit();

    float o[O_NTILES][4];
#pragma unroll
    for (int n = 0; n < O_NTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const int mi = lane >> 3, ri = lane & 7;
    constexpr int KS_PER_WARP = KSTEPS / NWARPS;  // 9
    uint32_t qa[KS_PER_WARP][4];

    for (int p = p_begin; p < p_end; ++p) {
        const int stage = (p - p_begin) & 1;
        if (p + 1 < p_end) {
            load_page(p + 1, stage ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16* KV = KVs + stage * PAGE * KV_STRIDE;

        // S = Q K^T for this warp's 16 keys.
        float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        if (p == p_begin) {
#pragma unroll
            for (int j = 0; j < KS_PER_WARP; ++j) {
                const bf16* q_lo = Qs + g * KV_STRIDE + (warp * KS_PER_WARP + j) * 16 + 2 * t4;
                qa[j][0] = lds32(q_lo);
                qa[j][1] = lds32(q_lo + 8 * KV_STRIDE);
                qa[j][2] = lds32(q_lo + 8);
                qa[j][3] = lds32(q_lo + 8 * KV_STRIDE + 8);
            }
        }
        float part[PAGE / 8][4];
#pragma unroll
        for (int nt = 0; nt < PAGE / 8; ++nt) part[nt][0] = part[nt][1] = part[nt][2] = part[nt][3] = 0.f;
#pragma unroll
        for (int j = 0; j < KS_PER_WARP; ++j) {
            const int ks = warp * KS_PER_WARP + j;
#pragma unroll
            for (int nt = 0; nt < PAGE / 8; ++nt) {
                const bf16* kr = KV + (nt * 8 + g) * KV_STRIDE + ks * 16 + 2 * t4;
                mma_bf16_16816(part[nt], qa[j], lds32(kr), lds32(kr + 8));
            }
        }
#pragma unroll
        for (int nt = 0; nt < PAGE / 8; ++nt)
            s_part[(warp * (PAGE / 8) + nt) * 32 + lane] = make_float4(part[nt][0], part[nt][1], part[nt][2], part[nt][3]);
        __syncthreads();
#pragma unroll
        for (int src = 0; src < NWARPS; ++src)
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const float4 v = s_part[(src * (PAGE / 8) + warp * 2 + n) * 32 + lane];
                sc[n][0] += v.x;
                sc[n][1] += v.y;
                sc[n][2] += v.z;
                sc[n][3] += v.w;
            }
        float wmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = p * PAGE + warp * 16 + n * 8 + 2 * t4 + (e & 1);
                sc[n][e] = key < len ? sc[n][e] * scale_log2 : -INFINITY;
                wmax[e >> 1] = fmaxf(wmax[e >> 1], sc[n][e]);
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            wmax[i] = fmaxf(wmax[i], __shfl_xor_sync(0xffffffffu, wmax[i], 1));
            wmax[i] = fmaxf(wmax[i], __shfl_xor_sync(0xffffffffu, wmax[i], 2));
        }
        if (t4 == 0) {
            red_max[warp * HT + g] = wmax[0];
            red_max[warp * HT + g + 8] = wmax[1];
        }
        __syncthreads();
        float m_use[2], alpha[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = g + 8 * i;
            float tm = red_max[row];
#pragma unroll
            for (int w = 1; w < NWARPS; ++w) tm = fmaxf(tm, red_max[w * HT + row]);
            const float m_new = fmaxf(m[i], tm);
            m_use[i] = m_new == -INFINITY ? 0.f : m_new;
            alpha[i] = exp2f(m[i] - m_use[i]);
            m[i] = m_new;
        }
        float wsum[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            const float p0 = exp2f(sc[n][0] - m_use[0]), p1 = exp2f(sc[n][1] - m_use[0]);
            const float p2 = exp2f(sc[n][2] - m_use[1]), p3 = exp2f(sc[n][3] - m_use[1]);
            wsum[0] += p0 + p1;
            wsum[1] += p2 + p3;
            const int col = warp * 16 + n * 8 + 2 * t4;
            *reinterpret_cast<uint32_t*>(Ps + g * P_STRIDE + col) = pack_bf16(p0, p1);
            *reinterpret_cast<uint32_t*>(Ps + (g + 8) * P_STRIDE + col) = pack_bf16(p2, p3);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            wsum[i] += __shfl_xor_sync(0xffffffffu, wsum[i], 1);
            wsum[i] += __shfl_xor_sync(0xffffffffu, wsum[i], 2);
        }
        if (t4 == 0) {
            red_sum[warp * HT + g] = wsum[0];
            red_sum[warp * HT + g + 8] = wsum[1];
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = g + 8 * i;
            float ts = 0.f;
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) ts += red_sum[w * HT + row];
            l[i] = l[i] * alpha[i] + ts;
        }
#pragma unroll
        for (int n = 0; n < O_NTILES; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }

        // O[:, warp's 128 dims] += P V, V = the c_kv part of the page.
#pragma unroll
        for (int kk = 0; kk < PAGE / 16; ++kk) {
            uint32_t pa[4];
            const bf16* p_lo = Ps + g * P_STRIDE + kk * 16 + 2 * t4;
            pa[0] = lds32(p_lo);
            pa[1] = lds32(p_lo + 8 * P_STRIDE);
            pa[2] = lds32(p_lo + 8);
            pa[3] = lds32(p_lo + 8 * P_STRIDE + 8);
#pragma unroll
            for (int vn = 0; vn < O_NTILES / 2; ++vn) {
                uint32_t bv[4];
                ldmatrix_x4_trans(bv, KV + (kk * 16 + ri + (mi & 1) * 8) * KV_STRIDE + warp * DIMS_PER_WARP + vn * 16 + (mi >> 1) * 8);
                mma_bf16_16816(o[2 * vn], pa, bv[0], bv[1]);
                mma_bf16_16816(o[2 * vn + 1], pa, bv[2], bv[3]);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int hh = h0 + g + 8 * i;
        if (hh >= heads) continue;
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        if (num_splits == 1) {
            bf16* dst = out + ((size_t)b * heads + hh) * DL + warp * DIMS_PER_WARP;
#pragma unroll
            for (int n = 0; n < O_NTILES; ++n)
                *reinterpret_cast<uint32_t*>(dst + n * 8 + 2 * t4) = pack_bf16(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
        } else {
            const size_t row = ((size_t)b * num_splits + split) * heads + hh;
            float* dst = part_o + row * DL + warp * DIMS_PER_WARP;
#pragma unroll
            for (int n = 0; n < O_NTILES; ++n) {
                dst[n * 8 + 2 * t4] = o[n][2 * i] * inv;
                dst[n * 8 + 2 * t4 + 1] = o[n][2 * i + 1] * inv;
            }
            if (warp == 0 && t4 == 0) part_lse[row] = l[i] > 0.f ? m[i] + log2f(l[i]) : -INFINITY;
        }
    }
}

#define MLA_DECODE_PARAMS                                                                             \
    const bf16* __restrict__ q, int q_stride, const bf16* __restrict__ cache,                         \
        const int* __restrict__ block_tables, const int* __restrict__ bt_stride_ptr,                   \
        const int* __restrict__ seq_lens, int heads, float scale_log2, int num_splits,                 \
        bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse
#define MLA_DECODE_ARGS \
    q, q_stride, cache, block_tables, bt_stride_ptr, seq_lens, heads, scale_log2, num_splits, out, part_o, part_lse

// QK^T split over the dims across the warps with Q's fragments in registers (see above); the one
// decode attention kernel, on every GPU (sm_90a cubin and compute_80 PTX).
extern "C" __global__ void __launch_bounds__(NTHREADS) mla_decode_attention_qregs(MLA_DECODE_PARAMS) {
    PDL_ENTRY();
    decode_attention_body(MLA_DECODE_ARGS);
}

// out[b, h, :] = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse). Grid (H, B, 4): each
// block merges 128 of the 512 dims, one per thread. The split weights are computed once into
// shared memory and the loads of eight splits are in flight together (a one-block-per-head
// version was latency-bound: 15 us for 32 splits at batch 1).
extern "C" __global__ void mla_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                              int heads, int num_splits, bf16* __restrict__ out) {
    PDL_ENTRY();
    __shared__ float w[64];
    __shared__ float total;
    const int h = blockIdx.x, b = blockIdx.y, d = blockIdx.z * NTHREADS + threadIdx.x;
    if (threadIdx.x < 32) {
        float l0 = threadIdx.x < num_splits ? part_lse[((size_t)b * num_splits + threadIdx.x) * heads + h] : -INFINITY;
        float l1 = threadIdx.x + 32 < num_splits ? part_lse[((size_t)b * num_splits + threadIdx.x + 32) * heads + h] : -INFINITY;
        const float mx = warp_max(fmaxf(l0, l1));
        const float w0 = (mx == -INFINITY || l0 == -INFINITY) ? 0.f : exp2f(l0 - mx);
        const float w1 = (mx == -INFINITY || l1 == -INFINITY) ? 0.f : exp2f(l1 - mx);
        w[threadIdx.x] = w0;
        w[threadIdx.x + 32] = w1;
        const float sum = warp_sum(w0 + w1);
        if (threadIdx.x == 0) total = sum;
    }
    __syncthreads();
    const float* base = part_o + ((size_t)b * num_splits * heads + h) * DL + d;
    const size_t step = (size_t)heads * DL;
    float acc = 0.f;
    int s = 0;
    for (; s + 8 <= num_splits; s += 8) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = base[(s + u) * step];
#pragma unroll
        for (int u = 0; u < 8; ++u) acc += w[s + u] * v[u];
    }
    for (; s < num_splits; ++s) acc += w[s] * base[s * step];
    out[((size_t)b * heads + h) * DL + d] = to_bf16(total > 0.f ? acc / total : 0.f);
}
