// DeepSeekMoE routing and token regrouping on the device, so that a MoE layer needs no host round
// trip: router top-k (softmax greedy / group-limited greedy, sigmoid noaux_tc with correction
// bias, as HF transformers computes them), grouping of (token, slot) assignments by expert into
// contiguous row ranges plus a tile map for the grouped GEMM, and the weighted combine. The gather
// of the grouped rows is elementwise.cu's gather_rows.
#include "common.cuh"

enum : int { ROUTE_GREEDY = 0, ROUTE_GROUP_LIMITED = 1, ROUTE_NOAUX_TC = 2 };
constexpr int MAX_EXPERTS_PER_LANE = 8;  // 256 experts per warp

// Warp-wide argmax over (value, index): larger value wins, then the lower index.
DEVICE_INLINE void warp_argmax(float& v, int& idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) {
            v = ov;
            idx = oi;
        }
    }
}

// One warp per token; expert e lives in lane e % 32, slot e / 32.
extern "C" __global__ void moe_route(const float* __restrict__ logits, const float* __restrict__ bias, int tokens,
                                     int experts, int top_k, int n_group, int topk_group, int method, int norm_topk,
                                     float routed_scale, int* __restrict__ topk_ids, float* __restrict__ topk_w) {
    PDL_ENTRY();
    const int warps = blockDim.x >> 5;
    const int t = blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= tokens) return;
    const float* row = logits + (size_t)t * experts;

    float score[MAX_EXPERTS_PER_LANE], choice[MAX_EXPERTS_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        score[j] = e < experts ? row[e] : -INFINITY;
        mx = fmaxf(mx, score[j]);
    }
    if (method == ROUTE_NOAUX_TC) {
#pragma unroll
        for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
            const int e = lane + 32 * j;
            score[j] = e < experts ? 1.f / (1.f + expf(-score[j])) : -INFINITY;
            choice[j] = e < experts ? score[j] + bias[e] : -INFINITY;
        }
    } else {
        mx = warp_max(mx);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
            const int e = lane + 32 * j;
            score[j] = e < experts ? expf(score[j] - mx) : 0.f;
            sum += score[j];
        }
        sum = warp_sum(sum);
#pragma unroll
        for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
            const int e = lane + 32 * j;
            score[j] = e < experts ? score[j] / sum : -INFINITY;
            choice[j] = score[j];
        }
    }

    if (method != ROUTE_GREEDY && n_group > 1) {
        const int per_group = experts / n_group;
        // Group scores: the best score (V2) or the sum of the two best biased scores (V3).
        float my_group_score = -INFINITY;  // lane gi holds group gi's score
        for (int gi = 0; gi < n_group; ++gi) {
            float v = -INFINITY;
            int idx = 0x7fffffff;
#pragma unroll
            for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
                const int e = lane + 32 * j;
                if (e / per_group == gi && e < experts && (choice[j] > v || (choice[j] == v && e < idx))) {
                    v = choice[j];
                    idx = e;
                }
            }
            warp_argmax(v, idx);
            float gs = v;
            if (method == ROUTE_NOAUX_TC) {
                float v2 = -INFINITY;
                int i2 = 0x7fffffff;
#pragma unroll
                for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
                    const int e = lane + 32 * j;
                    if (e / per_group == gi && e < experts && e != idx && choice[j] > v2) {
                        v2 = choice[j];
                        i2 = e;
                    }
                }
                warp_argmax(v2, i2);
                gs = v + v2;
            }
            if (lane == gi) my_group_score = gs;
        }
        // Keep the topk_group best groups; HF masks the others' experts with 0.0 for V2 (softmax
        // scores, never negative) and -inf for V3, whose biased scores may be negative: a 0.0
        // there could beat a kept expert.
        bool keep = false;
        float gv = lane < n_group ? my_group_score : -INFINITY;
        for (int r = 0; r < topk_group; ++r) {
            float v = gv;
            int idx = lane < n_group ? lane : 0x7fffffff;
            warp_argmax(v, idx);
            if (lane == idx) {
                keep = true;
                gv = -INFINITY;
            }
        }
        const unsigned kept = __ballot_sync(0xffffffffu, keep);
#pragma unroll
        for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
            const int e = lane + 32 * j;
            if (e < experts && !((kept >> (e / per_group)) & 1u))
                choice[j] = method == ROUTE_NOAUX_TC ? -INFINITY : 0.f;
        }
    }

    float my_w = 0.f;
    int my_id = -1;
    float wsum = 0.f;
    for (int r = 0; r < top_k; ++r) {
        float v = -INFINITY;
        int idx = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
            const int e = lane + 32 * j;
            if (e < experts && (choice[j] > v || (choice[j] == v && e < idx))) {
                v = choice[j];
                idx = e;
            }
        }
        warp_argmax(v, idx);
        // The owner lane reports the unbiased score and removes the expert from the race.
        float w = 0.f;
#pragma unroll
        for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j)
            if (lane + 32 * j == idx) {
                w = score[j];
                choice[j] = -INFINITY;
            }
        w = warp_sum(w);
        wsum += w;
        if (lane == r) {
            my_w = w;
            my_id = idx;
        }
    }
    if (lane < top_k) {
        float w = my_w;
        if (norm_topk) w = w / (wsum + 1e-20f);
        topk_ids[(size_t)t * top_k + lane] = my_id;
        topk_w[(size_t)t * top_k + lane] = w * routed_scale;
    }
}

// Groups the `tokens * top_k` assignments by expert. One block of 1024 threads.
//   expert_off[E + 1]: first grouped row of each expert; perm_src[row]: the token of a grouped row;
//   inv_row[t * top_k + j]: the grouped row of assignment j of token t;
//   tiles: (expert, first row, rows) of every `tile_m`-row tile, and their count in num_tiles[0].
extern "C" __global__ void moe_align(const int* __restrict__ topk_ids, int assignments, int top_k, int experts,
                                     int tile_m, int* __restrict__ expert_off, int* __restrict__ perm_src,
                                     int* __restrict__ inv_row, int* __restrict__ tile_expert,
                                     int* __restrict__ tile_row0, int* __restrict__ tile_rows,
                                     int* __restrict__ num_tiles) {
    PDL_ENTRY();
    __shared__ int count[1024], offset[1025], tile_off[1025], cursor[1024];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        count[e] = 0;
        cursor[e] = 0;
    }
    __syncthreads();
    for (int a = threadIdx.x; a < assignments; a += blockDim.x) atomicAdd(&count[topk_ids[a]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0, tacc = 0;
        for (int e = 0; e < experts; ++e) {
            offset[e] = acc;
            tile_off[e] = tacc;
            acc += count[e];
            tacc += (count[e] + tile_m - 1) / tile_m;
        }
        offset[experts] = acc;
        tile_off[experts] = tacc;
        num_tiles[0] = tacc;
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= experts; e += blockDim.x) expert_off[e] = offset[e];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        for (int j = 0; j * tile_m < count[e]; ++j) {
            const int tt = tile_off[e] + j;
            tile_expert[tt] = e;
            tile_row0[tt] = offset[e] + j * tile_m;
            tile_rows[tt] = min(tile_m, count[e] - j * tile_m);
        }
    }
    // Row order inside an expert does not matter: every grouped row is computed independently.
    for (int a = threadIdx.x; a < assignments; a += blockDim.x) {
        const int e = topk_ids[a];
        const int row = offset[e] + atomicAdd(&cursor[e], 1);
        perm_src[row] = a / top_k;
        inv_row[a] = row;
    }
}
// out[t, :] = sum_j w[t, j] * y[inv_row[t, j], :] (+ shared[t, :]), summed in f32. Grid
// (tokens, hidden / 512), 256 threads of two values each; the token's rows and weights are read
// once into shared memory so the top_k row loads are independent.
extern "C" __global__ void moe_combine(const bf16* __restrict__ y, const int* __restrict__ inv_row,
                                       const float* __restrict__ topk_w, const bf16* __restrict__ shared,
                                       bf16* __restrict__ out, int top_k, int hidden) {
    PDL_ENTRY();
    __shared__ int rows[32];
    __shared__ float ws[32];
    const int t = blockIdx.x;
    if (threadIdx.x < top_k) {
        rows[threadIdx.x] = inv_row[t * top_k + threadIdx.x];
        ws[threadIdx.x] = topk_w[t * top_k + threadIdx.x];
    }
    __syncthreads();
    const int i = 2 * (blockIdx.y * blockDim.x + threadIdx.x);
    if (i >= hidden) return;
    float a0 = 0.f, a1 = 0.f;
#pragma unroll 4
    for (int j = 0; j < top_k; ++j) {
        const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(y + (size_t)rows[j] * hidden + i);
        a0 += ws[j] * __low2float(v);
        a1 += ws[j] * __high2float(v);
    }
    // HF adds the routed sum (rounded to bf16) and the shared experts' bf16 output.
    a0 = round_bf16(a0);
    a1 = round_bf16(a1);
    if (shared) {
        const __nv_bfloat162 sv = *reinterpret_cast<const __nv_bfloat162*>(shared + (size_t)t * hidden + i);
        a0 += __low2float(sv);
        a1 += __high2float(sv);
    }
    *reinterpret_cast<uint32_t*>(out + (size_t)t * hidden + i) = pack_bf16(a0, a1);
}
