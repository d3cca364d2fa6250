#!/usr/bin/env python3
"""Runs `vllm bench serve` and `mla-bench serve` in turns against one server with the same
workload and prints each client's figures side by side: the two should agree within the run
to run noise, which the spread of each client's own runs shows.

    python crates/mla-bench/tests/vllm_compare.py --base-url http://127.0.0.1:8000 \
        --tokenizer assets/demo --runs 3 -- --random-input-len 256 --random-output-len 64 \
        --num-prompts 200 --max-concurrency 16

Arguments after `--` go to both clients unchanged. `--vllm` names the vllm executable (a venv
with `pip install vllm`; the client needs no GPU), `--mla-bench` the mla-bench binary. The
model is passed explicitly because vLLM reads a `root` field from /v1/models that mla-serve
does not list.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FIELDS = [
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
]


def run(cmd: list, out: Path) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--vllm", default="vllm")
    ap.add_argument("--mla-bench", default="target/debug/mla-bench")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    rest = [x for x in a.rest if x != "--"]
    common = ["--base-url", a.base_url, "--model", a.model, "--tokenizer", a.tokenizer, "--temperature", "0", *rest]
    results = {"vllm": [], "mla-bench": []}
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.runs):
            for name, exe in (("vllm", [a.vllm, "bench", "serve"]), ("mla-bench", [a.mla_bench, "serve"])):
                out = Path(d) / f"{name}-{i}.json"
                cmd = [*exe, *common, "--save-result", "--result-dir", d, "--result-filename", out.name]
                results[name].append(run(cmd, out))
                print(f"run {i + 1} {name}: {results[name][-1]['output_throughput']:.1f} output tok/s", file=sys.stderr)
    print(f"{'':<24}{'vllm bench serve':>26}{'mla-bench serve':>26}{'difference':>12}")
    for f in FIELDS:
        cells = []
        for name in ("vllm", "mla-bench"):
            vals = [r[f] for r in results[name] if r.get(f) is not None]
            mean = statistics.fmean(vals)
            spread = (max(vals) - min(vals)) / 2
            cells.append((mean, f"{mean:.2f} ± {spread:.2f}"))
        diff = (cells[1][0] - cells[0][0]) / cells[0][0] * 100 if cells[0][0] else 0.0
        print(f"{f:<24}{cells[0][1]:>26}{cells[1][1]:>26}{diff:>+11.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
