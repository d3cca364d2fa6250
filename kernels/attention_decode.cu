// Decode attention on the absorbed MLA path: MQA with one shared 576-wide key (c_kv 512 | k_pe 64)
// and 512-wide value (c_kv) read straight from the paged latent cache (page = 64 tokens).
//
// One block handles one request, one tile of 16 heads and one split of the request's pages, so
// every page is read once per head tile (once per request for V2-Lite's 16 heads). Splitting the
// KV length over blocks fills the GPU at small batch sizes; the splits are merged by a log-sum-exp
// combine. Everything that varies between steps (lengths, block tables) is read from device
// memory, so a captured CUDA graph stays valid for any contexts at the same batch size.
#include "common.cuh"
#include "latent_fp8.cuh"

namespace {
constexpr int DL = LATENT, DP = ROPE, D = DL + DP, PAGE = PAGE_SIZE, HT = DECODE_HEAD_TILE;
constexpr int KV_STRIDE = D + 8;  // 1168 bytes per row: conflict-free fragment and ldmatrix loads
constexpr int P_STRIDE = PAGE + 8;
constexpr int KSTEPS = D / 16;         // 36
constexpr int KEY_GROUPS = PAGE / 16;  // softmax and P: warp w handles keys [16 (w % 4), +16)
constexpr int FP8_ROW = LATENT_FP8_ROW_BYTES;
// The dynamic shared memory of the layout below, as the Rust wrapper asks for it (dims.cuh).
constexpr int smem_bytes(int nwarps, bool fp8) {
    return (HT * KV_STRIDE + (fp8 ? 1 : 2) * PAGE * KV_STRIDE + HT * P_STRIDE) * 2 + 2 * nwarps * HT * 4 +
        nwarps * (nwarps == 4 ? 8 : 2) * 32 * 16 + (fp8 ? 2 * PAGE * FP8_ROW : 0);
}
static_assert(smem_bytes(4, false) == DECODE_SMEM_BYTES_4W && smem_bytes(8, false) == DECODE_SMEM_BYTES_8W &&
                  smem_bytes(4, true) == DECODE_SMEM_BYTES_FP8_4W && smem_bytes(8, true) == DECODE_SMEM_BYTES_FP8_8W,
              "decode attention: dims.cuh's shared-memory sizes differ from the kernel's layout");
}  // namespace

// Two kernels share this body (NWARPS = 4 or 8); both keep Q's fragments in registers for the
// whole block (no re-reads of Q from shared memory per page), so each K element is read from
// shared memory once per page.
//
// Four warps (mla_decode_attention_4w, batches 2-31 and over 64): QK^T is split over the 576 dims only:
// warp w holds the k-steps [9w, 9w + 9), computes those dims' partial S for all 64 keys (8
// independent chains 9 deep), and the four partials of each key are summed through 32 KB of
// shared memory; row sums are reduced per page. This beat one chain per key tile over all 576
// dims by 6-9% in run D4 (docs/runs/2026-11-22.md).
//
// Eight warps (mla_decode_attention_8w, batch 1 and 32-64): two warps per SM sub-partition, so one
// warp's mma, shared-memory and barrier latencies overlap the other's. QK^T over 2 dim halves
// (18 k-steps, 72 registers of Q) x 4 key groups of 16 keys; the two warps of a key group sum their
// partial S through 8 KB (each writes its half, reads the other's; a + b in both, so both hold the
// same S) and both run that group's softmax; the dim-half-0 warp publishes the group's row max and
// P. The row sums stay per lane and are reduced once at the end (the rescale factor is the same in
// every warp), one barrier less per page. P V: each warp owns 64 of the 512 output dims. Against
// four warps: batch 1 -1%, 32-64 -2-3%, 2-16 +1-7%, 128-256 either way by machine, where both are
// bound by DRAM (runs E1-E4, T1, S7-S9 in docs/runs/2026-11-22.md; Rust's DecodeKernel::for_batch).
//
// Dynamic shared memory (the Rust wrapper computes the same): Q tile + two KV pages + P tile,
// row max/sum scratch, the partial-S exchange:
// (HT * KV_STRIDE + 2 * PAGE * KV_STRIDE + HT * P_STRIDE) * 2 + 2 * NWARPS * HT * 4 + NWARPS * (NWARPS == 4 ? 8 : 2) * 32 * 16
//
// FP8 cache (FP8 = true; latent_fp8.cuh): the pages' raw rows (592 bytes, half the bytes from
// DRAM) are double-buffered by cp.async into two staging pages at the end of shared memory, and
// each page is dequantized (exactly) into the one bf16 page the MMAs read, so everything after
// that is the bf16 kernel's arithmetic: on the same values both give the same bits.
template <int NWARPS, bool FP8>
__device__ __forceinline__ void decode_attention_body(
    const bf16* __restrict__ q, int q_stride,  // [B, H, 576]: q_lat (W_UK^T q_nope) | q_pe (roped)
    const void* __restrict__ cache_raw,        // [blocks * 64] rows of 576 bf16 or FP8 rows
    const int* __restrict__ block_tables,      // [B, *bt_stride]
    const int* __restrict__ bt_stride_ptr,     // row stride of block_tables (device scalar)
    const int* __restrict__ seq_lens,          // [B] keys per request, the fed token included
    int heads, float scale_log2, int num_splits,
    bf16* __restrict__ out,          // [B, H, 512], or null: write the partials even for one split
    float* __restrict__ part_o,      // [B, num_splits, H, 512]
    float* __restrict__ part_lse) {  // [B, num_splits, H] (log2 units)
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int DIM_GROUPS = NWARPS / KEY_GROUPS;  // 1 or 2 halves of the 576 dims for QK^T
    constexpr int KS_PER_WARP = NWARPS == 4 ? KSTEPS / 4 : KSTEPS / DIM_GROUPS;  // 9 (all 64 keys) or 18 (16 keys)
    constexpr int DIMS_PER_WARP = DL / NWARPS;                                   // of O: 128 or 64
    constexpr int O_NTILES = DIMS_PER_WARP / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
    bf16* KVs = Qs + HT * KV_STRIDE;
    bf16* Ps = KVs + (FP8 ? 1 : 2) * PAGE * KV_STRIDE;
    float* red_max = reinterpret_cast<float*>(Ps + HT * P_STRIDE);
    float* red_sum = red_max + NWARPS * HT;
    float4* s_part = reinterpret_cast<float4*>(red_sum + NWARPS * HT);  // [NWARPS][8 or 2 key tiles][32 lanes]
    unsigned char* staging = reinterpret_cast<unsigned char*>(s_part + NWARPS * (NWARPS == 4 ? 8 : 2) * 32);
    const bf16* cache = reinterpret_cast<const bf16*>(cache_raw);
    const unsigned char* cache8 = reinterpret_cast<const unsigned char*>(cache_raw);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int kg = warp % KEY_GROUPS, dg = warp / KEY_GROUPS;
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
        const size_t base = (size_t)table[p] * PAGE;
        const int valid = min(PAGE, len - p * PAGE);
        if constexpr (FP8) {
            // Zero-filled stale rows have zero codes and scale: zero values.
            unsigned char* dst = staging + stage * PAGE * FP8_ROW;
#pragma unroll 2
            for (int c = tid; c < PAGE * (FP8_ROW / 16); c += NTHREADS) {
                const int r = c / (FP8_ROW / 16), d = (c % (FP8_ROW / 16)) * 16;
                const bool ok = r < valid;
                cp_async_16(dst + r * FP8_ROW + d, cache8 + (base + (ok ? r : 0)) * FP8_ROW + d, ok);
            }
        } else {
            bf16* dst = KVs + stage * PAGE * KV_STRIDE;
#pragma unroll 2
            for (int c = tid; c < PAGE * (D / 8); c += NTHREADS) {
                const int r = c / (D / 8), d = (c % (D / 8)) * 8;
                const bool ok = r < valid;  // stale rows of the last page may hold anything, even NaN
                cp_async_16(dst + r * KV_STRIDE + d, cache + (base + (ok ? r : 0)) * D + d, ok);
            }
        }
    };
    if (p_begin < p_end) load_page(p_begin, 0);
    cp_async_commit();

    float o[O_NTILES][4];
#pragma unroll
    for (int n = 0; n < O_NTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    // m: the running row max (the same in every warp); l: the row sums (eight warps: this lane's share).
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const int mi = lane >> 3, ri = lane & 7;
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
        if constexpr (FP8) {
            // This page's staged rows to the bf16 page (the previous page's readers finished at
            // the loop's last barrier), 16 codes of one scale group per thread and step.
            const unsigned char* src = staging + stage * PAGE * FP8_ROW;
#pragma unroll 3
            for (int c = tid; c < PAGE * (D / 16); c += NTHREADS) {
                const int r = c / (D / 16), j = c % (D / 16);
                const unsigned char* row = src + r * FP8_ROW;
                const uint4 codes = *reinterpret_cast<const uint4*>(row + j * 16);
                const __nv_bfloat162 f = latent_fp8_factor(row[D + j * 16 / LATENT_FP8_GROUP]);
                uint4* dst = reinterpret_cast<uint4*>(KVs + r * KV_STRIDE + j * 16);
                dst[0] = latent_fp8x8_to_bf16(make_uint2(codes.x, codes.y), f);
                dst[1] = latent_fp8x8_to_bf16(make_uint2(codes.z, codes.w), f);
            }
            __syncthreads();
        }
        const bf16* KV = KVs + (FP8 ? 0 : stage * PAGE * KV_STRIDE);

        if (p == p_begin) {
#pragma unroll
            for (int j = 0; j < KS_PER_WARP; ++j) {
                const bf16* q_lo = Qs + g * KV_STRIDE + ((NWARPS == 4 ? warp : dg) * KS_PER_WARP + j) * 16 + 2 * t4;
                qa[j][0] = lds32(q_lo);
                qa[j][1] = lds32(q_lo + 8 * KV_STRIDE);
                qa[j][2] = lds32(q_lo + 8);
                qa[j][3] = lds32(q_lo + 8 * KV_STRIDE + 8);
            }
        }
        // S of this warp's key group (16 keys; rows g, g + 8 in sc[n][0..1], sc[n][2..3]).
        float sc[2][4];
        if constexpr (NWARPS == 4) {
            // Partial S of all 64 keys over this warp's 144 dims, then the four partials summed.
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
                s_part[(warp * (PAGE / 8) + nt) * 32 + lane] =
                    make_float4(part[nt][0], part[nt][1], part[nt][2], part[nt][3]);
            __syncthreads();
#pragma unroll
            for (int n = 0; n < 2; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
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
        } else {
            // Partial S of the group's 16 keys over this warp's 288 dims (four chains 9 deep), plus
            // the other dim half's.
            float acc[2][2][4];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int c = 0; c < 2; ++c) acc[nt][c][0] = acc[nt][c][1] = acc[nt][c][2] = acc[nt][c][3] = 0.f;
#pragma unroll
            for (int j = 0; j < KS_PER_WARP; ++j) {
                const int ks = dg * KS_PER_WARP + j;
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const bf16* kr = KV + (kg * 16 + nt * 8 + g) * KV_STRIDE + ks * 16 + 2 * t4;
                    mma_bf16_16816(acc[nt][j & 1], qa[j], lds32(kr), lds32(kr + 8));
                }
            }
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[nt][e] = acc[nt][0][e] + acc[nt][1][e];
                s_part[(warp * 2 + nt) * 32 + lane] = make_float4(sc[nt][0], sc[nt][1], sc[nt][2], sc[nt][3]);
            }
            __syncthreads();
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const float4 v = s_part[((warp ^ KEY_GROUPS) * 2 + nt) * 32 + lane];
                sc[nt][0] += v.x;
                sc[nt][1] += v.y;
                sc[nt][2] += v.z;
                sc[nt][3] += v.w;
            }
        }
        float wmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = p * PAGE + kg * 16 + n * 8 + 2 * t4 + (e & 1);
                sc[n][e] = key < len ? sc[n][e] * scale_log2 : -INFINITY;
                wmax[e >> 1] = fmaxf(wmax[e >> 1], sc[n][e]);
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            wmax[i] = quad_max(wmax[i]);
        }
        if (dg == 0 && t4 == 0) {
            red_max[kg * HT + g] = wmax[0];
            red_max[kg * HT + g + 8] = wmax[1];
        }
        __syncthreads();
        float m_use[2], alpha[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = g + 8 * i;
            float tm = red_max[row];
#pragma unroll
            for (int w = 1; w < KEY_GROUPS; ++w) tm = fmaxf(tm, red_max[w * HT + row]);
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
            if (dg == 0) {
                const int col = kg * 16 + n * 8 + 2 * t4;
                *reinterpret_cast<uint32_t*>(Ps + g * P_STRIDE + col) = pack_bf16(p0, p1);
                *reinterpret_cast<uint32_t*>(Ps + (g + 8) * P_STRIDE + col) = pack_bf16(p2, p3);
            }
        }
        if constexpr (NWARPS == 4) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                wsum[i] = quad_sum(wsum[i]);
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
        } else {
#pragma unroll
            for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + wsum[i];
        }
#pragma unroll
        for (int n = 0; n < O_NTILES; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
        if constexpr (NWARPS == 8) __syncthreads();  // P complete (four warps: the row-sum barrier)

        // O[:, warp's dims] += P V, V = the c_kv part of the page.
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
                ldmatrix_x4_trans(
                    bv,
                    KV + (kk * 16 + ri + (mi & 1) * 8) * KV_STRIDE + warp * DIMS_PER_WARP + vn * 16 + (mi >> 1) * 8);
                mma_bf16_16816(o[2 * vn], pa, bv[0], bv[1]);
                mma_bf16_16816(o[2 * vn + 1], pa, bv[2], bv[3]);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();

    if constexpr (NWARPS == 8) {
        // Row sums: the four lanes of a row, then the four key groups (dim-half-0 warps).
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            l[i] = quad_sum(l[i]);
        }
        if (dg == 0 && t4 == 0) {
            red_sum[kg * HT + g] = l[0];
            red_sum[kg * HT + g + 8] = l[1];
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = g + 8 * i;
            float ts = 0.f;
#pragma unroll
            for (int w = 0; w < KEY_GROUPS; ++w) ts += red_sum[w * HT + row];
            l[i] = ts;
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int hh = h0 + g + 8 * i;
        if (hh >= heads) continue;
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        if (out != nullptr) {
            bf16* dst = out + ((size_t)b * heads + hh) * DL + warp * DIMS_PER_WARP;
#pragma unroll
            for (int n = 0; n < O_NTILES; ++n)
                *reinterpret_cast<uint32_t*>(dst + n * 8 + 2 * t4) =
                    pack_bf16(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
        } else {
            const size_t row = ((size_t)b * num_splits + split) * heads + hh;
            float* dst = part_o + row * DL + warp * DIMS_PER_WARP;
#pragma unroll
            for (int n = 0; n < O_NTILES; ++n)
                *reinterpret_cast<float2*>(dst + n * 8 + 2 * t4) =
                    make_float2(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
            if (warp == 0 && t4 == 0) part_lse[row] = l[i] > 0.f ? m[i] + log2f(l[i]) : -INFINITY;
        }
    }
}

#define MLA_DECODE_PARAMS                                                                                           \
    const bf16 *__restrict__ q, int q_stride, const void *__restrict__ cache, const int *__restrict__ block_tables, \
        const int *__restrict__ bt_stride_ptr, const int *__restrict__ seq_lens, int heads, float scale_log2,       \
        int num_splits, bf16 *__restrict__ out, float *__restrict__ part_o, float *__restrict__ part_lse
#define MLA_DECODE_ARGS \
    q, q_stride, cache, block_tables, bt_stride_ptr, seq_lens, heads, scale_log2, num_splits, out, part_o, part_lse

// The two decode attention kernels (see above), on every GPU (sm_90a cubin and compute_80 PTX).
extern "C" __global__ void __launch_bounds__(128) mla_decode_attention_4w(MLA_DECODE_PARAMS) {
    PDL_ENTRY();
    decode_attention_body<4, false>(MLA_DECODE_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) mla_decode_attention_8w(MLA_DECODE_PARAMS) {
    PDL_ENTRY();
    decode_attention_body<8, false>(MLA_DECODE_ARGS);
}
// The same over an FP8 latent cache.
extern "C" __global__ void __launch_bounds__(128) mla_decode_attention_fp8_4w(MLA_DECODE_PARAMS) {
    PDL_ENTRY();
    decode_attention_body<4, true>(MLA_DECODE_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) mla_decode_attention_fp8_8w(MLA_DECODE_PARAMS) {
    PDL_ENTRY();
    decode_attention_body<8, true>(MLA_DECODE_ARGS);
}

// The merge weights of one (request, head): w[s] = 2^(lse_s - max lse) for s < 64, *total = their
// sum; run by one warp. Shared by both merges so that they round identically.
__device__ __forceinline__ void split_weights(const float* __restrict__ part_lse, int b, int h, int heads,
                                              int num_splits, float* w, float* total) {
    const int lane = threadIdx.x & 31;
    float l0 = lane < num_splits ? part_lse[((size_t)b * num_splits + lane) * heads + h] : -INFINITY;
    float l1 = lane + 32 < num_splits ? part_lse[((size_t)b * num_splits + lane + 32) * heads + h] : -INFINITY;
    const float mx = warp_max(fmaxf(l0, l1));
    const float w0 = (mx == -INFINITY || l0 == -INFINITY) ? 0.f : exp2f(l0 - mx);
    const float w1 = (mx == -INFINITY || l1 == -INFINITY) ? 0.f : exp2f(l1 - mx);
    w[lane] = w0;
    w[lane + 32] = w1;
    const float sum = warp_sum(w0 + w1);
    if (lane == 0) *total = sum;
}

// out[b, h, :] = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse). Grid (H, B, 4): each
// block merges 128 of the 512 dims, one per thread. The split weights are computed once into
// shared memory and the loads of eight splits are in flight together (a one-block-per-head
// version was latency-bound: 15 us for 32 splits at batch 1).
extern "C" __global__ void mla_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                              int heads, int num_splits, bf16* __restrict__ out) {
    PDL_ENTRY();
    constexpr int DIMS_PER_BLOCK = 128;  // one thread per dim, launched with 128 threads
    __shared__ float w[64];
    __shared__ float total;
    const int h = blockIdx.x, b = blockIdx.y, d = blockIdx.z * DIMS_PER_BLOCK + threadIdx.x;
    if (threadIdx.x < 32) split_weights(part_lse, b, h, heads, num_splits, w, &total);
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

// For decode steps of up to 4 tokens: the merge above and the output absorption in one launch,
// attn_out[b, h * 128 + d] = sum_c W_UV[h][d][c] o_lat[b, h, c], W_UV[h] = rows h * 256 + 128 ..
// h * 256 + 256 of kv_b_proj [H * 256, 512], o_lat rounded to bf16 exactly as mla_decode_combine
// writes it (same weights, same order of the sum over the splits); f32 products on the tensor
// cores. Replaces mla_decode_combine and a cuBLAS batched GEMM (two launches) at small batches.
//
// Grid (128 / DQ, H), 256 threads: a block owns DQ output dims of one head. Before the PDL wait it
// starts copying its DQ x 512 of W_UV into shared memory (cp.async), which overlaps the attention
// kernel where a block fits next to an attention block; after it the block merges o_lat[:, h, :]
// for all 512 latent dims (each thread two dims per token, float2 loads, 32 loads in flight: 16
// were 1.5 us slower at batch 4 in run S8) into shared memory, each warp multiplies its 64 latent
// dims (DQ / 16 m16n8k16 row tiles x four k-steps, tokens as the n = 8 columns), and the eight
// partial products are summed in warp order. The blocks of a head merge the same o_lat (from L2).
namespace absorb {
constexpr int MAXB = COMBINE_ABSORB_MAX_BATCH, DQ = COMBINE_ABSORB_DIMS, MT = DQ / 16, NWARPS = 8,
              KS = DL / 16 / NWARPS;  // KS = 4 k-steps per warp
constexpr int STRIDE = DL + 8;        // bf16 rows; conflict-free fragments

// acc[b] (latent dims c, c + 1 of token b) = sum over the splits in order of w[b][s] o_s, NB tokens,
// 32 / NB splits per token in flight.
template <int NB>
__device__ __forceinline__ void merge(const float2* const* base, size_t step, int num_splits, const float (*w)[64],
                                      float2* acc) {
    constexpr int U = 32 / NB;
    int s = 0;
#pragma unroll 1
    for (; s + U <= num_splits; s += U) {
        float2 v[NB][U];
#pragma unroll
        for (int bb = 0; bb < NB; ++bb)
#pragma unroll
            for (int u = 0; u < U; ++u) v[bb][u] = base[bb][(s + u) * step];
#pragma unroll
        for (int bb = 0; bb < NB; ++bb)
#pragma unroll
            for (int u = 0; u < U; ++u) {
                acc[bb].x += w[bb][s + u] * v[bb][u].x;
                acc[bb].y += w[bb][s + u] * v[bb][u].y;
            }
    }
#pragma unroll 1
    for (; s < num_splits; ++s)
#pragma unroll
        for (int bb = 0; bb < NB; ++bb) {
            const float2 v = base[bb][s * step];
            acc[bb].x += w[bb][s] * v.x;
            acc[bb].y += w[bb][s] * v.y;
        }
}
}  // namespace absorb

// At most 128 registers, no spills.
extern "C" __global__ void __launch_bounds__(256, 2)
    mla_decode_combine_absorb_o(const float* __restrict__ part_o, const float* __restrict__ part_lse, int heads,
                                int num_splits, int batch, const bf16* __restrict__ kv_b, bf16* __restrict__ out) {
    using namespace absorb;
    __shared__ __align__(16) bf16 w_s[DQ][STRIDE];
    __shared__ __align__(16) bf16 o_s[MAXB][STRIDE];
    __shared__ float w[MAXB][64];
    __shared__ float total[MAXB];
    __shared__ float4 red[NWARPS][MT][32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int d0 = blockIdx.x * DQ, h = blockIdx.y;

    const bf16* wuv = kv_b + ((size_t)h * 256 + 128 + d0) * DL;
    for (int i = tid; i < DQ * DL / 8; i += 256)
        cp_async_16(&w_s[i / (DL / 8)][i % (DL / 8) * 8], wuv + (size_t)i * 8, true);
    cp_async_commit();
    PDL_ENTRY();

    if (warp < batch) split_weights(part_lse, warp, h, heads, num_splits, w[warp], &total[warp]);
    __syncthreads();
    // This thread merges latent dims c, c + 1 of every token.
    const int c = 2 * tid;
    const size_t step = (size_t)heads * DL / 2;  // float2 elements from one split to the next
    float2 acc[MAXB];
    const float2* base[MAXB];
#pragma unroll
    for (int bb = 0; bb < MAXB; ++bb) {
        acc[bb] = make_float2(0.f, 0.f);
        base[bb] =
            reinterpret_cast<const float2*>(part_o + ((size_t)min(bb, batch - 1) * num_splits * heads + h) * DL + c);
    }
    switch (batch) {
        case 1:
            merge<1>(base, step, num_splits, w, acc);
            break;
        case 2:
            merge<2>(base, step, num_splits, w, acc);
            break;
        case 3:
            merge<3>(base, step, num_splits, w, acc);
            break;
        default:
            merge<4>(base, step, num_splits, w, acc);
            break;
    }
#pragma unroll
    for (int bb = 0; bb < MAXB; ++bb) {
        const float t = total[min(bb, batch - 1)];
        const bool live = bb < batch && t > 0.f;
        *reinterpret_cast<__nv_bfloat162*>(&o_s[bb][c]) =
            __halves2bfloat162(to_bf16(live ? acc[bb].x / t : 0.f), to_bf16(live ? acc[bb].y / t : 0.f));
    }
    cp_async_wait<0>();
    __syncthreads();

    // Partial out[d][b] over this warp's 64 latent dims: A = W_UV rows, B columns = tokens (g < 4).
    float cacc[MT][4] = {};
#pragma unroll
    for (int j = 0; j < KS; ++j) {
        const int k0 = warp * (KS * 16) + j * 16 + 2 * t4;
        const uint32_t b0 = g < MAXB ? lds32(&o_s[g & (MAXB - 1)][k0]) : 0u;
        const uint32_t b1 = g < MAXB ? lds32(&o_s[g & (MAXB - 1)][k0 + 8]) : 0u;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const bf16* r = &w_s[mt * 16 + g][k0];
            const uint32_t a[4] = {lds32(r), lds32(r + 8 * STRIDE), lds32(r + 8), lds32(r + 8 * STRIDE + 8)};
            mma_bf16_16816(cacc[mt], a, b0, b1);
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        red[warp][mt][lane] = make_float4(cacc[mt][0], cacc[mt][1], cacc[mt][2], cacc[mt][3]);
    __syncthreads();
    // Thread (mt, lane) sums the eight warps' C fragments: rows (dims) d0 + 16 mt + {g, g + 8},
    // columns (tokens) 2 t4, 2 t4 + 1.
    if (tid < MT * 32) {
        const int mt = tid >> 5;
        float4 sum = red[0][mt][lane];
#pragma unroll
        for (int src = 1; src < NWARPS; ++src) {
            const float4 v = red[src][mt][lane];
            sum.x += v.x;
            sum.y += v.y;
            sum.z += v.z;
            sum.w += v.w;
        }
        const int b = 2 * t4;
        const size_t row = (size_t)heads * 128;
        bf16* dst = out + (size_t)h * 128 + d0 + mt * 16 + g;
        if (b < batch) {
            dst[b * row] = to_bf16(sum.x);
            dst[b * row + 8] = to_bf16(sum.z);
        }
        if (b + 1 < batch) {
            dst[(b + 1) * row] = to_bf16(sum.y);
            dst[(b + 1) * row + 8] = to_bf16(sum.w);
        }
    }
}
