#!/usr/bin/env python3
"""Plots docs/performance.png from the benchmark JSON in benches/results/.

Left: decode throughput of the offline engine (mla-bench engine) against batch size, with the
physical limit of a decode step drawn for the contexts measured: every byte a step must read
(weights of the attention, dense and shared layers, the lm_head, the routed experts that a batch
of B tokens touches under uniform routing, and the latent KV cache of B sequences) over the
H200's memory bandwidth. Right: output throughput of HTTP serving (mla-bench serve) against
concurrency.

usage: scripts/plot_performance.py --engine E.json [E2.json ...] --serve S.json [...] \
           --config configs/deepseek-v2-lite.json --out docs/performance.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

H200_BW = 4.8e12  # bytes/s, the H200 datasheet's HBM3e bandwidth; a measured device copy reaches 4.26e12


def step_bytes(cfg, batch, ctx):
    """Bytes one bf16 decode step must read at batch `batch` and context `ctx`."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    qd = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    lat = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    if cfg.get("q_lora_rank"):
        q = h * cfg["q_lora_rank"] + cfg["q_lora_rank"] * heads * qd
    else:
        q = h * heads * qd
    attn = q + h * lat + cfg["kv_lora_rank"] * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]) + heads * cfg["v_head_dim"] * h
    dense_layers = cfg.get("first_k_dense_replace", 0)
    moe_layers = layers - dense_layers
    e, k, im = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    touched = e * (1 - (1 - k / e) ** batch)  # distinct experts hit by `batch` tokens, uniform routing
    params = layers * attn
    params += dense_layers * 3 * h * cfg["intermediate_size"]
    params += moe_layers * (3 * h * im * cfg["n_shared_experts"] + e * h + touched * 3 * h * im)
    params += cfg["vocab_size"] * h  # lm_head
    kv = batch * ctx * layers * lat * 2
    return 2 * params + kv


def limit_tok_s(cfg, batch, ctx):
    return batch / (step_bytes(cfg, batch, ctx) / H200_BW)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", nargs="*", default=[])
    ap.add_argument("--serve", nargs="*", default=[])
    ap.add_argument("--config", default="configs/deepseek-v2-lite.json")
    ap.add_argument("--out", default="docs/performance.png")
    a = ap.parse_args()
    cfg = json.load(open(a.config))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    contexts = set()
    series = {True: ([], set()), False: ([], set())}  # graphs? -> (points, commits)
    for path in a.engine:
        doc = json.load(open(path))
        r = doc["results"]
        pts, commits = series[bool(r.get("cuda_graph_batch_sizes"))]
        commits.add(doc["git_commit"])
        pts.extend((d["batch"], d["tokens_per_s"], d["context"]) for d in r["decode"])
    for graphs, (pts, commits) in series.items():
        if not pts:
            continue
        pts.sort()
        contexts.update(c for _, _, c in pts)
        label = f"mla-serve engine, {'CUDA graphs' if graphs else 'eager'} ({', '.join(sorted(commits))})"
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if graphs else "s--", label=label)
        for b, t, c in pts:
            ax1.annotate(f"{t:,.0f} (ctx {c})", (b, t), textcoords="offset points", xytext=(4, 4 if graphs else -12), fontsize=7)
    bs = [2 ** i for i in range(0, 9)]
    for c in sorted(contexts):
        ax1.plot(bs, [limit_tok_s(cfg, b, c) for b in bs], ":", label=f"physical limit, ctx {c} (bytes / 4.8 TB/s)")
    ax1.plot([1, 256], [600, 12000], "rx", ms=9, label="2026-11-22 targets: B=1 ctx 1k 600, B=256 ctx 4k 12,000")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("decode batch size")
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("Decode, DeepSeek-V2-Lite shape, one H200")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7)
    pts = []
    for path in a.serve:
        doc = json.load(open(path))
        r = doc["results"]
        pts.append((r["max_concurrency"], r["metrics"]["output_throughput"], r["metrics"]["itl"]["median_ms"]))
    if pts:
        pts.sort()
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="mla-serve over HTTP, random 1024 in / 256 out")
        for c, t, itl in pts:
            ax2.annotate(f"{t:,.0f} tok/s, median ITL {itl:.2f} ms", (c, t), textcoords="offset points", xytext=(4, -12), fontsize=7)
        ax2.axhline(8000, color="gray", ls="--", lw=0.8, label="target at concurrency 256: 8,000 tok/s")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("max concurrency")
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("Serving (mla-bench serve)")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote", a.out)
    for c in sorted(contexts) or [4096]:
        print(f"limit ctx {c}: " + ", ".join(f"B={b} {limit_tok_s(cfg, b, c):,.0f}" for b in (1, 64, 256)))


if __name__ == "__main__":
    main()
