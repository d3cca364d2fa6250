#!/usr/bin/env python3
"""How often a sampled draft stands under three verification rules (docs/speculative-decoding.md).

For a target distribution p and a draft distribution q (softmaxes of Gaussian logits over a
2,000-token vocabulary, q's logits perturbed by sigma), it prints:
- rejection sampling (accept d ~ q with min(1, p/q), else draw from max(p - q, 0)): 1 - TV(p, q),
  the most any lossless rule can accept;
- quantile coupling: draft and target both drawn by inverse CDF from the same uniform over their
  own descending order (what mla-serve's sampler does today); a draft stands when both pick the
  same token. Outputs would equal the non-speculative ones for every seed;
- Gumbel coupling: both drawn as argmax(log prob + g) with the same Gumbel noise g per token id;
  also identical outputs for every seed.

    python3 scripts/spec_coupling.py      (numpy; about 10 s)
"""

import numpy as np

V, TRIALS, DRAWS = 2000, 5, 4000
rng = np.random.default_rng(0)


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def quantile_coupling(p, q):
    """Measure of the uniforms u for which the inverse CDFs over each side's order agree."""
    op, oq = np.argsort(-p, kind="stable"), np.argsort(-q, kind="stable")
    cp, cq = np.concatenate([[0], np.cumsum(p[op])]), np.concatenate([[0], np.cumsum(q[oq])])
    where_q = np.empty(len(q), dtype=int)
    where_q[oq] = np.arange(len(q))
    j = where_q[op]
    lo, hi = np.maximum(cp[:-1], cq[j]), np.minimum(cp[1:], cq[j + 1])
    return np.clip(hi - lo, 0, None).sum()


def gumbel_coupling(p, q):
    g = rng.gumbel(size=(DRAWS, len(p)))
    return np.mean(np.argmax(np.log(p) + g, 1) == np.argmax(np.log(q) + g, 1))


print("sigma   1-TV (rejection)   quantile coupling   Gumbel coupling")
for sigma in [0.1, 0.3, 0.5, 1.0, 1.5, 2.0]:
    rows = []
    for _ in range(TRIALS):
        z = rng.normal(size=V) * 2.5
        p, q = softmax(z), softmax(z + sigma * rng.normal(size=V))
        rows.append((1 - 0.5 * np.abs(p - q).sum(), quantile_coupling(p, q), gumbel_coupling(p, q)))
    r = np.mean(rows, 0)
    print(f"{sigma:5.1f}   {r[0]:16.3f}   {r[1]:17.3f}   {r[2]:15.3f}")
