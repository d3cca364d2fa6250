// What the sampler (sampling.cu) and the speculative verdicts (speculative.cu) share: a row's
// parameters, block-wide passes over a vocabulary row, and the set of tokens a row keeps under
// temperature, top-k, top-p and min-p. One definition, so that a verdict recomputes exactly the
// distribution a draft was drawn from.
#pragma once
#include "common.cuh"

struct __align__(8) SampleParams {
    float temperature;  // < 1e-5: greedy
    float top_p;        // 1: off
    float min_p;        // 0: off
    int top_k;          // 0: off
    float repetition_penalty, frequency_penalty, presence_penalty;
    int n_logprobs;  // top alternatives to report (0..=20); < 0: no log-probabilities
    unsigned long long seed;
    int pen_begin, pen_end;    // range of this row's penalty entries
    int bias_begin, bias_end;  // range of this row's logit-bias entries
    int mask_row;              // row of the step's mask table; < 0: every token allowed
    // >= 0: the row's token is decided already (a speculative verdict, speculative.cu); the
    // sampler only reports its log-probabilities. < 0: the sampler draws.
    int forced_token;
};
static_assert(sizeof(SampleParams) == 64, "SampleParams is mirrored by SampleParamsRaw (ops/sampling.rs)");

struct BlockArgmax {
    float v;
    int i;
};

DEVICE_INLINE bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

DEVICE_INLINE BlockArgmax block_argmax(float v, int i, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = lane < nwarps ? sv[lane] : -INFINITY;
    i = lane < nwarps ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    return {v, i};
}

// Calls f(i, x[i]) for this thread's share of a row, with many loads in flight before their
// uses: one block walks a whole 129k-entry row per pass, and a pass is bound by the bytes in
// flight on its SM. A plain strided loop left one dependent load per iteration; eight scalar
// loads per thread still made a pass about 26 us on an H200 (33 passes for top-p, run S17);
// eight 16-byte loads per thread carry four times as many bytes. Rows not 16-byte aligned take
// the scalar path.
template <typename F>
DEVICE_INLINE void for_row(const float* __restrict__ x, int n, F f) {
    const int bd = blockDim.x;
    int i = threadIdx.x;
    if ((reinterpret_cast<uintptr_t>(x) & 15) == 0) {
        const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x);
        const int n4 = n >> 2;
        for (; i + 7 * bd < n4; i += 8 * bd) {
            float4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = x4[i + u * bd];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int b = 4 * (i + u * bd);
                f(b, v[u].x);
                f(b + 1, v[u].y);
                f(b + 2, v[u].z);
                f(b + 3, v[u].w);
            }
        }
        for (; i < n4; i += bd) {
            const float4 v = x4[i];
            f(4 * i, v.x);
            f(4 * i + 1, v.y);
            f(4 * i + 2, v.z);
            f(4 * i + 3, v.w);
        }
        for (i = 4 * n4 + threadIdx.x; i < n; i += bd) f(i, x[i]);
        return;
    }
    for (; i + 7 * bd < n; i += 8 * bd) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = x[i + u * bd];
#pragma unroll
        for (int u = 0; u < 8; ++u) f(i + u * bd, v[u]);
    }
    for (; i < n; i += bd) f(i, x[i]);
}

// The tokens a sampled row keeps, as value thresholds (sampling.cu's header says why not a
// sort): finite, at or above the top-k/top-p key `pkey`, and with a scaled logit at or above
// log(min_p). A row's draw weighs each kept token by exp((v - wm) * inv_t).
struct KeptSet {
    float wm;  // the row's largest logit
    float inv_t;
    uint32_t pkey;
    float log_min_p;
};

DEVICE_INLINE bool kept(const KeptSet& k, float v) {
    return v != -INFINITY && float_key(v) >= k.pkey && (v - k.wm) * k.inv_t >= k.log_min_p;
}

// The kept set of row `w` under `p` (a sampled row: temperature above 1e-5). Block-wide: every
// thread calls it and gets the result.
DEVICE_INLINE KeptSet kept_set(const float* __restrict__ w, int vocab, const SampleParams& p, float* sf, double* sd) {
    const float inv_t = 1.f / p.temperature;
    float wm = -INFINITY;
    for_row(w, vocab, [&](int, float v) { wm = fmaxf(wm, v); });
    wm = block_max(wm, sf);
    // top-k: the key of the k-th largest value, built bit by bit from the top. When fewer than
    // k tokens are finite it is the key of -inf, which keeps every token; the -inf ones still
    // cannot be drawn (`kept`).
    uint32_t kkey = 0;
    if (p.top_k > 0 && p.top_k < vocab) {
        for (int bit = 31; bit >= 0; --bit) {
            const uint32_t cand = kkey | (1u << bit);
            float cnt = 0.f;
            for_row(w, vocab, [&](int, float v) { cnt += float_key(v) >= cand ? 1.f : 0.f; });
            if (block_sum(cnt, sf) >= (float)p.top_k) kkey = cand;
        }
    }
    // top-p: the largest threshold whose kept mass (relative to the top-k set) reaches top_p.
    // -inf tokens weigh exp(-inf) = 0. The bisection takes 33 passes over the row on one SM, so
    // each pass is lean: a token's weight is a float exp, summed in float per thread (at most a
    // few hundred terms) and in double across the block. With a double exp per token a pass took
    // about 55 us on an H200 at a 129k vocabulary (1.8 ms per sampled row at top-p 0.9, run S15);
    // with float exps summed in double, about 23 us (S17, S18).
    uint32_t pkey = kkey;
    if (p.top_p < 1.f && wm > -INFINITY) {
        float zt = 0.f;
        for_row(w, vocab, [&](int, float v) {
            if (float_key(v) >= kkey) zt += expf((v - wm) * inv_t);
        });
        const double target = (double)p.top_p * block_sum_f64((double)zt, sd);
        uint32_t key = 0;
        for (int bit = 31; bit >= 0; --bit) {
            const uint32_t cand = key | (1u << bit);
            float mass = 0.f;
            for_row(w, vocab, [&](int, float v) {
                const uint32_t k = float_key(v);
                if (k >= cand && k >= kkey) mass += expf((v - wm) * inv_t);
            });
            if (block_sum_f64((double)mass, sd) >= target) key = cand;
        }
        pkey = max(pkey, key);
    }
    return {wm, inv_t, pkey, p.min_p > 0.f ? logf(p.min_p) : -INFINITY};
}

// Gumbel noise of token `i` under `seed`: counter-based, so a seed draws the same token whatever
// the batch looks like.
DEVICE_INLINE float gumbel(uint64_t seed, int i) {
    const double u = uniform_open(mix64(seed ^ mix64(0x5851F42D4C957F2Dull + (uint64_t)i)));
    return (float)(-log(-log(u)));
}

// Whether a row shapes its logits before it is drawn from (a mask, a bias or penalties).
DEVICE_INLINE bool shapes(const SampleParams& p) {
    return p.mask_row >= 0 || p.bias_end > p.bias_begin || p.pen_end > p.pen_begin;
}

// The logits a row is drawn from: `raw` itself, or, when the row shapes them, its working copy
// `wr` written here: masked tokens to -inf, biases added, then the penalties (vLLM's order).
// Bias entries name each token once, so no two threads write one entry. `penalty_table` and
// `bias_table` are device words holding the addresses of the step's penalty and bias entries
// (sampling.cu says why), `mask_table` its mask rows; each is read only when the row uses it.
// Ends with the block in step, every write visible.
DEVICE_INLINE const float* shaped_row(const float* __restrict__ raw, float* __restrict__ wr, int vocab,
                                      const SampleParams& p, const int* const* __restrict__ penalty_table,
                                      const int* const* __restrict__ bias_table,
                                      const unsigned* __restrict__ mask_table) {
    if (!shapes(p)) return raw;
    if (p.mask_row >= 0) {
        const unsigned* allowed = mask_table + (size_t)p.mask_row * ((vocab + 31) / 32);
        for_row(raw, vocab, [&](int i, float v) { wr[i] = (allowed[i >> 5] >> (i & 31)) & 1u ? v : -INFINITY; });
    } else {
        for_row(raw, vocab, [&](int i, float v) { wr[i] = v; });
    }
    __syncthreads();
    if (p.bias_end > p.bias_begin) {
        const int* bias = *bias_table;
        for (int e = p.bias_begin + threadIdx.x; e < p.bias_end; e += blockDim.x) {
            // -inf stays -inf whatever the bias (-inf + -inf, or a masked token's finite bias).
            wr[bias[2 * e]] += __int_as_float(bias[2 * e + 1]);
        }
        __syncthreads();
    }
    if (p.pen_end > p.pen_begin) {
        const int* pen = *penalty_table;
        for (int e = p.pen_begin + threadIdx.x; e < p.pen_end; e += blockDim.x) {
            const int tok = pen[3 * e], c = pen[3 * e + 1], seen = pen[3 * e + 2];
            float v = wr[tok];
            if (seen && p.repetition_penalty != 1.f) v = v > 0.f ? v / p.repetition_penalty : v * p.repetition_penalty;
            if (c > 0) v -= p.frequency_penalty * (float)c + p.presence_penalty;
            wr[tok] = v;
        }
        __syncthreads();
    }
    return wr;
}

// The log-sum-exp of a row in f32 (its log-probabilities are `x - lse`), as the sampler has
// always reported them. Uniform across the block.
DEVICE_INLINE float row_lse(const float* __restrict__ raw, int vocab, float* sf) {
    float mx = -INFINITY;
    for_row(raw, vocab, [&](int, float v) { mx = fmaxf(mx, v); });
    mx = block_max(mx, sf);
    float se = 0.f;
    for_row(raw, vocab, [&](int, float v) { se += expf(v - mx); });
    return mx + logf(block_sum(se, sf));
}

// The `k` largest entries of a row as (id, x - lse), most likely first, ties by lower id (as
// torch.topk and mla_core::sampling::top_k_entries): k block-wide passes, each taking the best
// entry strictly after the previous pick. Thread 0 writes `ids[0..k]` and `lps[0..k]`.
DEVICE_INLINE void top_entries(const float* __restrict__ raw, int vocab, int k, float lse, int* ids, float* lps,
                               float* sf, int* si) {
    float pv = INFINITY;
    int pi = -1;
    for (int j = 0; j < k; ++j) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for_row(raw, vocab, [&](int i, float v) {
            const bool after = v < pv || (v == pv && i > pi);
            if (after && better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        });
        const BlockArgmax b = block_argmax(bv, bi, sf, si);
        if (threadIdx.x == 0) {
            ids[j] = b.i;
            lps[j] = b.v - lse;
        }
        pv = b.v;
        pi = b.i;
    }
}
