// Token sampling on the device, one block of SAMPLER_THREADS threads per sequence.
//
// Semantics follow mla-core's reference sampler (vLLM order): logit bias and the structured-output
// mask first (a disallowed token is -inf from then on), penalties, then temperature (0 means
// greedy), top-k, top-p and min-p filtering, then one seeded draw; log-probabilities are those of
// the unmodified model distribution. The filters are computed as value thresholds instead of a
// sort: top-k by radix selection of the k-th largest logit, top-p by bisection on the threshold
// whose kept probability mass first reaches top_p, min-p in closed form. Ties at a threshold are
// all kept. The draw is a Gumbel-max over the kept tokens with counter-based noise from
// (seed, token id), so a seed gives the same token whatever the batch looks like. A -inf token
// (masked, or biased by -inf) is never drawn while any token is finite: it may pass a threshold
// (top-k asking for more tokens than are allowed), but its Gumbel score stays -inf. A row with no
// finite logit at all takes the greedy token (the lowest index).
#include "sampling_rows.cuh"

extern "C" __global__ void __launch_bounds__(SAMPLER_THREADS)
    sample_tokens(const float* __restrict__ logits, long long logits_stride, int vocab,
                  const SampleParams* __restrict__ params,
                  // A device word holding the address of the penalty entries (token, output count, seen in
                  // prompt or output): read at run time, so a captured graph follows the buffer when it grows.
                  const int* const* __restrict__ penalty_table,
                  // Likewise for the logit-bias entries: (token, bias as float bits) pairs.
                  const int* const* __restrict__ bias_table,
                  // [mask rows, ceil(vocab / 32)]: bit t % 32 of word t / 32 set = token t allowed.
                  const unsigned* __restrict__ mask_table, float* __restrict__ work, int* __restrict__ out_token,
                  float* __restrict__ out_logprob, int* __restrict__ out_top_ids, float* __restrict__ out_top_lps) {
    PDL_ENTRY();
    __shared__ float sf[32];
    __shared__ int si[32];
    __shared__ double sd[32];
    const int r = blockIdx.x;
    const SampleParams p = params[r];
    const float* raw = logits + r * logits_stride;

    // Log-probabilities of the unmodified distribution (skipped when none were asked for).
    float lse = 0.f;
    if (p.n_logprobs >= 0) {
        float mx = -INFINITY;
        for_row(raw, vocab, [&](int, float v) { mx = fmaxf(mx, v); });
        mx = block_max(mx, sf);
        float se = 0.f;
        for_row(raw, vocab, [&](int, float v) { se += expf(v - mx); });
        lse = mx + logf(block_sum(se, sf));
    }
    if (p.n_logprobs > 0) {
        float pv = INFINITY;
        int pi = -1;
        for (int k = 0; k < p.n_logprobs; ++k) {
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            for_row(raw, vocab, [&](int i, float v) {
                const bool after = v < pv || (v == pv && i > pi);  // strictly after the previous pick
                if (after && better(v, i, bv, bi)) {
                    bv = v;
                    bi = i;
                }
            });
            const BlockArgmax b = block_argmax(bv, bi, sf, si);
            if (threadIdx.x == 0) {
                out_top_ids[r * MAX_TOP_LOGPROBS + k] = b.i;
                out_top_lps[r * MAX_TOP_LOGPROBS + k] = b.v - lse;
            }
            pv = b.v;
            pi = b.i;
        }
    }

    // The row as it is drawn from: shaped by mask, bias and penalties in `work` when it asks.
    const float* w = shaped_row(raw, work + (size_t)r * vocab, vocab, p, penalty_table, bias_table, mask_table);

    // Greedy: the largest working logit, lowest index on ties (every token -inf: token 0).
    auto greedy = [&]() {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for_row(w, vocab, [&](int i, float v) {
            if (better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        });
        return block_argmax(bv, bi, sf, si).i;
    };
    int token;
    if (p.forced_token >= 0) {
        token = p.forced_token;
    } else if (p.temperature < 1e-5f) {
        token = greedy();
    } else {
        const KeptSet k = kept_set(w, vocab, p, sf, sd);
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        if (k.wm > -INFINITY) {
            for_row(w, vocab, [&](int i, float v) {
                // A -inf token is never a candidate (its score would be -inf, and -inf ties are
                // broken by index, which could pick it over nothing).
                if (!kept(k, v)) return;
                const float score = (v - k.wm) * k.inv_t + gumbel(p.seed, i);
                if (better(score, i, bv, bi)) {
                    bv = score;
                    bi = i;
                }
            });
        }
        token = block_argmax(bv, bi, sf, si).i;
        // No candidate (no finite logit in the row): the greedy token. Uniform across the block.
        if (token == 0x7fffffff) token = greedy();
    }
    if (threadIdx.x == 0) {
        out_token[r] = token;
        out_logprob[r] = p.n_logprobs >= 0 ? raw[token] - lse : 0.f;
    }
}
