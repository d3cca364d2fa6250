// The verdict on sampled drafts, on the device (speculative decoding; the rule is
// mla_core::speculative's, the host reference these kernels are held to): a draft d drawn from
// q stands with probability min(1, p(d) / q(d)); otherwise the row emits a draw from
// max(p - q, 0), and the drafts after it are dropped. p and q are the sampler's own distributions
// (sampling_rows.cuh), of the verify row's logits and of the MTP row's logits the draft was drawn
// from, which the rank keeps (`spec_keep_rows`) until the next step verifies them.
//
// Three launches, after the verify step's logits and before its sampler:
// - `spec_distributions`, one block per row (a verified sequence's target rows, then its drafts'
//   rows): the row's kept set and normaliser, the expensive part, in parallel over every row. A
//   target row whose request has a logit bias or penalties is shaped first, into the sampler's
//   working copy of that row, as the sampler shapes it (`shaped_row`): each verify row has its
//   own penalty entries, which count the drafts before it (mla_core::speculative::row_request);
// - `spec_verdicts`, one block per sequence: the acceptance tests in order, each O(1), and one
//   pass over the vocabulary at the first rejection. It writes each decided row's token into
//   the row's `forced_token`; the sampler then reports its log-probabilities and draws the rows
//   left undecided (the row after every fed draft stood: the bonus token, a draw from p).
// A row after a rejection is forced to the replacement too: it emits nothing, and the host finds
// the emitted count as for greedy drafts (up to the first row whose token is not its draft; a
// replacement never is, since max(p - q, 0) is zero at a rejected draft).
#include "sampling_rows.cuh"

// One row whose distribution a verdict needs.
struct SpecRow {
    const float* logits;
    int params_row;  // the sampler row whose parameters shape it
    // 1: a target row, shaped (bias, penalties) as the sampler will shape it, into that sampler
    // row's working copy, which the verdict then reads. 0: a kept draft row, kept as drawn from.
    int shape;
};
static_assert(sizeof(SpecRow) == 16, "SpecRow is mirrored by SpecRowRaw (ops/speculative.rs)");

// A row's distribution: token t with logit v has probability exp((v - wm) * inv_t) / z if kept.
struct RowDistribution {
    KeptSet k;
    double z;
};
static_assert(sizeof(RowDistribution) == 24, "RowDistribution is sized by ops/speculative.rs");

DEVICE_INLINE double prob(const RowDistribution& d, float v) {
    return kept(d.k, v) ? exp((double)((v - d.k.wm) * d.k.inv_t)) / d.z : 0.0;
}

// One sequence's drafts to verify.
struct SpecVerdict {
    const float* q_logits;  // the drafts' MTP rows, `vocab` apart; null: verify against point masses
    int row0;               // its first verify row among the sampler's rows
    int fed;                // drafts fed, at most MAX_SPEC_DRAFTS
    int dist0;              // its target rows' distributions, then (with q) its drafts'
    int reserved;
    int drafts[MAX_SPEC_DRAFTS];
};
static_assert(sizeof(SpecVerdict) == 24 + 4 * MAX_SPEC_DRAFTS, "SpecVerdict is mirrored by SpecVerdictRaw");

// Salts that keep a verdict's uniforms apart from the sampler's draw of the same row (whose
// seed it shares) and from each other.
constexpr uint64_t ACCEPT_SALT = 0x6A09E667F3BCC909ull;
constexpr uint64_t RESIDUAL_SALT = 0xBB67AE8584CAA73Bull;

extern "C" __global__ void __launch_bounds__(SAMPLER_THREADS)
    spec_distributions(const SpecRow* __restrict__ rows, const SampleParams* __restrict__ params, int vocab,
                       const int* const* __restrict__ penalty_table, const int* const* __restrict__ bias_table,
                       const unsigned* __restrict__ mask_table, float* __restrict__ work,
                       RowDistribution* __restrict__ out) {
    PDL_ENTRY();
    __shared__ float sf[32];
    __shared__ double sd[32];
    const SpecRow r = rows[blockIdx.x];
    const SampleParams p = params[r.params_row];
    const float* row = r.shape
        ? shaped_row(r.logits, work + (size_t)r.params_row * vocab, vocab, p, penalty_table, bias_table, mask_table)
        : r.logits;
    const KeptSet k = kept_set(row, vocab, p, sf, sd);
    double z = 0.0;
    for_row(row, vocab, [&](int, float v) {
        if (kept(k, v)) z += exp((double)((v - k.wm) * k.inv_t));
    });
    z = block_sum_f64(z, sd);
    if (threadIdx.x == 0) out[blockIdx.x] = {k, z};
}

extern "C" __global__ void __launch_bounds__(512)
    spec_verdicts(const SpecVerdict* __restrict__ seqs, const float* __restrict__ logits, long long stride, int vocab,
                  const RowDistribution* __restrict__ dists, SampleParams* __restrict__ params,
                  const float* __restrict__ work) {
    PDL_ENTRY();
    __shared__ float sf[32];
    __shared__ int si[32];
    const SpecVerdict s = seqs[blockIdx.x];
    for (int j = 0; j < s.fed; ++j) {
        const int r = s.row0 + j, d = s.drafts[j];
        // The row as `spec_distributions` saw it: its working copy where it shapes.
        const float* t = shapes(params[r]) ? work + (size_t)r * vocab : logits + (long long)r * stride;
        const float* q = s.q_logits ? s.q_logits + (long long)j * vocab : nullptr;
        const RowDistribution P = dists[s.dist0 + j];
        const RowDistribution Q = q ? dists[s.dist0 + s.fed + j] : RowDistribution{};
        const uint64_t seed = params[r].seed;
        const double pd = prob(P, t[d]);
        const double qd = q ? prob(Q, q[d]) : 1.0;
        // qd = 0 cannot happen for a draft drawn from q: treat it as never proposed, rejected.
        const bool stands = qd > 0.0 && uniform_open(mix64(seed ^ ACCEPT_SALT)) * qd < pd;
        int token = d;
        if (!stands) {
            // Gumbel-max over log max(p - q, 0): a draw from the residual, never normalised.
            const uint64_t rs = mix64(seed ^ RESIDUAL_SALT);
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            for_row(t, vocab, [&](int i, float v) {
                const double ri = prob(P, v) - (q ? prob(Q, q[i]) : (i == d ? 1.0 : 0.0));
                if (!(ri > 0.0)) return;
                const float score = (float)log(ri) + gumbel(rs, i);
                if (better(score, i, bv, bi)) {
                    bv = score;
                    bi = i;
                }
            });
            token = block_argmax(bv, bi, sf, si).i;
            if (token == 0x7fffffff) {
                // p is nowhere above q (equal up to rounding, so a rejection had probability
                // about 0): a draw from p without the draft, which must not seem to stand.
                bv = -INFINITY;
                bi = 0x7fffffff;
                for_row(t, vocab, [&](int i, float v) {
                    if (i == d || !kept(P.k, v)) return;
                    const float score = (v - P.k.wm) * P.k.inv_t + gumbel(rs, i);
                    if (better(score, i, bv, bi)) {
                        bv = score;
                        bi = i;
                    }
                });
                token = block_argmax(bv, bi, sf, si).i;
                // p holds the draft alone: then it stood with certainty; keep it.
                if (token == 0x7fffffff) token = d;
            }
        }
        if (token == d) {
            if (threadIdx.x == 0) params[r].forced_token = d;
            continue;
        }
        // Rejected: this row and every row after it emit the replacement (those after emit
        // nothing; forcing them spares their draws).
        for (int k = j + threadIdx.x; k <= s.fed; k += blockDim.x) params[s.row0 + k].forced_token = token;
        return;
    }
}

// Copies whole logits rows as they were drawn from: pair i copies sampler row pairs[2i] (of
// `src`, or of the sampler's working copy `work` where the row's parameters shaped it: a draft
// drawn under the request's logit bias) to row pairs[2i + 1] of `dst`.
extern "C" __global__ void __launch_bounds__(256)
    spec_keep_rows(const float* __restrict__ src, const float* __restrict__ work,
                   const SampleParams* __restrict__ params, const int* __restrict__ pairs, float* __restrict__ dst,
                   int vocab) {
    PDL_ENTRY();
    const int row = pairs[2 * blockIdx.x];
    const float* a = (shapes(params[row]) ? work : src) + (long long)row * vocab;
    float* b = dst + (long long)pairs[2 * blockIdx.x + 1] * vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) b[i] = a[i];
}
