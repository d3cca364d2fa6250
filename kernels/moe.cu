// DeepSeekMoE routing and token regrouping on the device, so that a MoE layer needs no host round
// trip: router top-k (softmax greedy / group-limited greedy, sigmoid noaux_tc with correction
// bias, as HF transformers computes them), grouping of (token, slot) assignments by expert into
// contiguous row ranges plus a tile map for the grouped GEMM, and the weighted combine. The gather
// of the grouped rows is elementwise.cu's gather_rows.
#include "common.cuh"

enum : int { ROUTE_GREEDY = 0, ROUTE_GROUP_LIMITED = 1, ROUTE_NOAUX_TC = 2 };

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

// The two largest of a multiset of values (a group's score needs values only: which of two equal
// experts is "second" does not change the sum).
DEVICE_INLINE void merge_top2(float& a1, float& a2, float b1, float b2) {
    const float hi = fmaxf(a1, b1);
    a2 = fmaxf(fminf(a1, b1), fmaxf(a2, b2));
    a1 = hi;
}

// One warp per token. The warp's lanes split into `groups` runs of `lanes` lanes (32 / n_group
// for group-limited routing, else one run of 32), a run per expert group; lane l of a run holds
// `slots` consecutive experts of its group, in ascending order. So a group's best two and a
// lane's best candidate come from registers and a few shuffles within the run, and a scan in slot
// order breaks ties toward the lower index as torch.topk does. The first version kept expert e in
// lane e % 32 and ran a full warp argmax per group and per pick (28 for V3, each 5 dependent
// shuffle pairs) with a division per register: 12.6 us a token under ncu (run S31).
template <int SLOTS>
DEVICE_INLINE void moe_route_body(const float* __restrict__ logits, const float* __restrict__ bias, int tokens,
                                  int experts, int top_k, int n_group, int topk_group, int method, int norm_topk,
                                  float routed_scale, int* __restrict__ topk_ids, float* __restrict__ topk_w) {
    constexpr unsigned FULL = 0xffffffffu;
    const int warps = blockDim.x >> 5;
    const int t = blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const bool grouped = method != ROUTE_GREEDY && n_group > 1;
    const int groups = grouped ? n_group : 1;
    const int lanes = 32 / groups;
    const int per_group = experts / groups;
    const int slots = (per_group + lanes - 1) / lanes;  // <= SLOTS (the launcher picks the instance)
    const int group = lane / lanes;                     // == groups for the spare lanes past the last run
    const int in_group = (lane - group * lanes) * slots;
    const int mine = group < groups ? max(0, min(slots, per_group - in_group)) : 0;
    const int first = group * per_group + in_group;  // this lane's experts: first .. first + mine - 1

    // The correction bias is a weight: read it before waiting on the router's logits.
    float b[SLOTS];
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) b[j] = method == ROUTE_NOAUX_TC && j < mine ? __ldg(bias + first + j) : 0.f;
    PDL_ENTRY();
    if (t >= tokens) return;
    const float* row = logits + (size_t)t * experts;

    float score[SLOTS], choice[SLOTS];
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) score[j] = j < mine ? row[first + j] : -INFINITY;
    if (method == ROUTE_NOAUX_TC) {
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) {
            score[j] = j < mine ? 1.f / (1.f + expf(-score[j])) : -INFINITY;
            choice[j] = j < mine ? score[j] + b[j] : -INFINITY;
        }
    } else {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) mx = fmaxf(mx, score[j]);
        mx = warp_max(mx);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) {
            score[j] = j < mine ? expf(score[j] - mx) : 0.f;
            sum += score[j];
        }
        sum = warp_sum(sum);
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) {
            score[j] = j < mine ? score[j] / sum : -INFINITY;
            choice[j] = score[j];
        }
    }

    if (grouped) {
        // Group scores: the best score (V2) or the sum of the two best biased scores (V3), folded
        // toward each run's first lane.
        float v1 = -INFINITY, v2 = -INFINITY;
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) merge_top2(v1, v2, choice[j], -INFINITY);
        const int r = lane - group * lanes;
        for (int o = 1; o < lanes; o <<= 1) {
            const float o1 = __shfl_down_sync(FULL, v1, o), o2 = __shfl_down_sync(FULL, v2, o);
            if (r + o < lanes) merge_top2(v1, v2, o1, o2);
        }
        const float gs = method == ROUTE_NOAUX_TC ? v1 + v2 : v1;
        // Rank this lane's group among all (a better score, or an equal one of a lower group,
        // ranks ahead) and keep the topk_group best. HF masks the others' experts with 0.0 for V2
        // (softmax scores, never negative) and -inf for V3, whose biased scores may be negative:
        // a 0.0 there could beat a kept expert.
        const float own = __shfl_sync(FULL, gs, min(group, groups - 1) * lanes);
        int rank = 0;
        for (int h = 0; h < groups; ++h) {
            const float other = __shfl_sync(FULL, gs, h * lanes);
            rank += other > own || (other == own && h < group);
        }
        if (rank >= topk_group) {
#pragma unroll
            for (int j = 0; j < SLOTS; ++j)
                if (j < mine) choice[j] = method == ROUTE_NOAUX_TC ? -INFINITY : 0.f;
        }
    }

    // top_k picks: each lane offers its best unpicked expert, the warp takes the best offer, its
    // owner reports the unbiased score. Picked experts leave the race by a bit, not a value, so
    // that a masked (-inf) expert can still be picked once, by index, as torch.topk would.
    unsigned picked = 0;
    float my_w = 0.f;
    int my_id = -1;
    float wsum = 0.f;
    for (int k = 0; k < top_k; ++k) {
        float v = -INFINITY;
        int best = -1;
#pragma unroll
        for (int j = 0; j < SLOTS; ++j)
            if (j < mine && !((picked >> j) & 1u) && (best < 0 || choice[j] > v)) {
                v = choice[j];
                best = j;
            }
        int idx = best >= 0 ? first + best : 0x7fffffff;
        warp_argmax(v, idx);
        const bool owner = best >= 0 && idx == first + best;
        float w = 0.f;
        if (owner) {
            picked |= 1u << best;
#pragma unroll
            for (int j = 0; j < SLOTS; ++j)
                if (j == best) w = score[j];
        }
        w = __shfl_sync(FULL, w, __ffs(__ballot_sync(FULL, owner)) - 1);
        wsum += w;
        if (lane == k) {
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

// Instances by experts a lane holds (RouteParams::lane_slots): a loop over 16 slots for V2-Lite's
// 2 cost 0.03-0.05 ms a decode step (run S44).
#define MOE_ROUTE(SLOTS)                                                                                            \
    extern "C" __global__ void moe_route_s##SLOTS(const float* __restrict__ logits, const float* __restrict__ bias, \
                                                  int tokens, int experts, int top_k, int n_group, int topk_group,  \
                                                  int method, int norm_topk, float routed_scale,                    \
                                                  int* __restrict__ topk_ids, float* __restrict__ topk_w) {         \
        moe_route_body<SLOTS>(logits, bias, tokens, experts, top_k, n_group, topk_group, method, norm_topk,         \
                              routed_scale, topk_ids, topk_w);                                                      \
    }
MOE_ROUTE(2)
MOE_ROUTE(4)
MOE_ROUTE(8)
MOE_ROUTE(16)
static_assert(16 == MOE_ROUTE_MAX_SLOTS, "dims.cuh's most experts a lane differs from the largest instance");

// Inclusive prefix sums of two counts across a warp's lanes (lane l gets the sums over lanes 0..l).
DEVICE_INLINE void warp_inclusive_scan2(int& a, int& b, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int ao = __shfl_up_sync(0xffffffffu, a, o), bo = __shfl_up_sync(0xffffffffu, b, o);
        if (lane >= o) {
            a += ao;
            b += bo;
        }
    }
}

// Groups the `tokens * top_k` assignments by expert. One block of 1024 threads (experts <= 1024).
//   expert_off[E + 1]: first grouped row of each expert; perm_src[row]: the token of a grouped row;
//   inv_row[t * top_k + j]: the grouped row of assignment j of token t;
//   tiles: (expert, first row, rows) of every `tile_m`-row tile, and their count in num_tiles[0].
// The experts' row and tile offsets are a block-wide scan (thread e holds expert e): a serial
// loop over V3's 256 experts in one thread kept the kernel at 16.8 us for a step of 8 rows (ncu,
// run S48).
extern "C" __global__ void moe_align(const int* __restrict__ topk_ids, int assignments, int top_k, int experts,
                                     int tile_m, int* __restrict__ expert_off, int* __restrict__ perm_src,
                                     int* __restrict__ inv_row, int* __restrict__ tile_expert,
                                     int* __restrict__ tile_row0, int* __restrict__ tile_rows,
                                     int* __restrict__ num_tiles) {
    PDL_ENTRY();
    __shared__ int count[1024], offset[1025], tile_off[1025], cursor[1024], warp_rows[32], warp_tiles[32];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        count[e] = 0;
        cursor[e] = 0;
    }
    __syncthreads();
    for (int a = threadIdx.x; a < assignments; a += blockDim.x) atomicAdd(&count[topk_ids[a]], 1);
    __syncthreads();
    {
        // Inclusive scans of (rows, tiles) within each warp, then over the warps' totals.
        const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
        const int rows = e < experts ? count[e] : 0, tiles = (rows + tile_m - 1) / tile_m;
        int r = rows, t = tiles;
        warp_inclusive_scan2(r, t, lane);
        if (lane == 31) {
            warp_rows[warp] = r;
            warp_tiles[warp] = t;
        }
        __syncthreads();
        if (warp == 0) {
            int wr = lane < (int)(blockDim.x >> 5) ? warp_rows[lane] : 0;
            int wt = lane < (int)(blockDim.x >> 5) ? warp_tiles[lane] : 0;
            warp_inclusive_scan2(wr, wt, lane);
            warp_rows[lane] = wr;
            warp_tiles[lane] = wt;
        }
        __syncthreads();
        const int row_base = warp > 0 ? warp_rows[warp - 1] : 0, tile_base = warp > 0 ? warp_tiles[warp - 1] : 0;
        if (e < experts) {
            offset[e] = row_base + r - rows;
            tile_off[e] = tile_base + t - tiles;
        }
        if (e == experts - 1) {
            offset[experts] = row_base + r;
            tile_off[experts] = tile_base + t;
            num_tiles[0] = tile_base + t;
        }
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
