#!/usr/bin/env python3
"""Sums an `ncu --csv --page raw --metrics gpu__time_duration.sum` capture by kernel family and
by step, for docs/performance.md's time breakdowns. A step starts at each `embedding_gather`.

usage: ncu_breakdown.py NCU.csv [STEP_NAMES ...]
"""
import csv
import sys
from collections import OrderedDict

FAMILIES = [
    ("moe grouped GEMM", ("moe_grouped_gemm",)),
    ("FP8 activation quantizer", ("fp8_quantize_act",)),
    ("FP8 weight GEMV", ("gemv_fp8",)),
    ("decode attention + combine", ("mla_decode",)),
    ("prefill attention", ("mla_prefill",)),
    ("cuBLAS GEMMs", ("nvjet", "gemm", "Gemm", "cutlass", "sm90_xmma", "cublas", "splitK", "gemv", "Kernel2")),
    ("elementwise (silu_mul, conversions, embedding)", ("silu_mul", "bf16_to_f32", "embedding", "gather_rows")),
    ("MoE routing/align/gather/combine", ("moe_",)),
    ("norms (rmsnorm, add_rmsnorm)", ("rmsnorm",)),
    ("RoPE + cache write, latent gather", ("rope", "latent")),
    ("sampling", ("sample",)),
]


def family(name):
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other (" + name.split("(")[0][:40] + ")"


def main():
    path = sys.argv[1]
    names = sys.argv[2:]
    lines = open(path).read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    hdr = rows[0]
    ki, ti = hdr.index("Kernel Name"), hdr.index("gpu__time_duration.sum")
    unit = rows[1][ti]
    scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3}[unit]
    steps = []
    for r in rows[2:]:
        if len(r) <= ti or not r[ti]:
            continue
        name, us = r[ki], float(r[ti].replace(",", "")) * scale
        if name.startswith("embedding") or not steps:
            steps.append([])
        steps[-1].append((name, us))
    for s, kernels in enumerate(steps):
        label = names[s] if s < len(names) else f"step {s}"
        total = sum(us for _, us in kernels)
        fams = OrderedDict()
        for name, us in kernels:
            f = family(name)
            c, t = fams.get(f, (0, 0.0))
            fams[f] = (c + 1, t + us)
        print(f"## {label}: {len(kernels)} kernels, {total / 1e3:.3f} ms of kernel time")
        print("| kernel family | launches | ms | share |")
        print("|---|---|---|---|")
        for f, (c, t) in sorted(fams.items(), key=lambda kv: -kv[1][1]):
            print(f"| {f} | {c} | {t / 1e3:.3f} | {100 * t / total:.0f}% |")
        print()


if __name__ == "__main__":
    main()
