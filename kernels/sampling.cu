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
    const float lse = p.n_logprobs >= 0 ? row_lse(raw, vocab, sf) : 0.f;
    if (p.n_logprobs > 0)
        top_entries(raw, vocab, p.n_logprobs, lse, out_top_ids + r * MAX_TOP_LOGPROBS,
                    out_top_lps + r * MAX_TOP_LOGPROBS, sf, si);

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

// One scored row (mla_core's LogitsRequest::Scored): logits row `row`, scored against `token`,
// with its `top` most likely tokens. Mirrored by ScoreRowRaw (ops/sampling.rs).
struct ScoreRow {
    int row, token, top;
};
static_assert(sizeof(ScoreRow) == 12, "ScoreRow is mirrored by ScoreRowRaw");

// Prompt logprobs on the device, one block per scored row: the token's log-probability under
// the unmodified distribution, its rank (1 + the tokens with a larger logit, as vLLM counts
// it) and the top alternatives, as the sampler reports a draw's (mla_core::sampling::score is
// the reference). Only these few words per row go to the host, never the row itself.
extern "C" __global__ void __launch_bounds__(SAMPLER_THREADS)
    score_rows(const float* __restrict__ logits, long long logits_stride, int vocab, const ScoreRow* __restrict__ rows,
               float* __restrict__ out_logprob, int* __restrict__ out_rank, int* __restrict__ out_top_ids,
               float* __restrict__ out_top_lps) {
    PDL_ENTRY();
    __shared__ float sf[32];
    __shared__ int si[32];
    const ScoreRow s = rows[blockIdx.x];
    const float* raw = logits + s.row * logits_stride;
    const float lse = row_lse(raw, vocab, sf);
    const float own = raw[s.token];
    float above = 0.f;  // exact: counts stay far below 2^24
    for_row(raw, vocab, [&](int, float v) { above += v > own ? 1.f : 0.f; });
    above = block_sum(above, sf);
    if (threadIdx.x == 0) {
        out_logprob[blockIdx.x] = own - lse;
        out_rank[blockIdx.x] = 1 + (int)above;
    }
    top_entries(raw, vocab, s.top, lse, out_top_ids + blockIdx.x * MAX_TOP_LOGPROBS,
                out_top_lps + blockIdx.x * MAX_TOP_LOGPROBS, sf, si);
}
