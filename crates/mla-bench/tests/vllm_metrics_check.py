#!/usr/bin/env python3
"""Recomputes the summary of a `--save-result --save-detailed` file from its per-request lists
with vLLM's own `calculate_metrics` and compares every figure, so mla-bench's arithmetic is
checked against vLLM's on the same recorded timings.

    python crates/mla-bench/tests/vllm_metrics_check.py RESULT.json [--goodput ttft:200 ...]
        [--percentiles 50,99]

It needs `vllm` importable (a venv with `pip install vllm`; the benchmark code runs without a
GPU). It reads files written by either client, so running it on a `vllm bench serve` result
checks the check. Exit status 1 on any mismatch.

One figure is not compared: `max_concurrent_requests`. vLLM 0.33 counts the requests active
during each whole second (so a run shorter than a second reports every request), while vLLM's
main branch and mla-bench count the most requests in flight at one instant.
"""

import argparse
import json
import math
import sys

from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
from vllm.benchmarks.serve import calculate_metrics

SKIPPED = {"max_concurrent_requests"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("result")
    ap.add_argument("--goodput", nargs="*", default=[])
    ap.add_argument("--percentiles", default=None, help="default: those the file holds")
    a = ap.parse_args()

    with open(a.result) as f:
        r = json.load(f)
    if "ttfts" not in r:
        print("the file has no per-request lists: save it with --save-detailed")
        return 2
    if a.percentiles:
        percentiles = [float(p) for p in a.percentiles.split(",")]
    else:
        words = {k.split("_")[0][1:] for k in r if k.startswith("p") and k.endswith("_ttft_ms")}
        percentiles = sorted(float(w) for w in words) or [99.0]
    goodput = {k: float(v) for k, v in (g.split(":") for g in a.goodput)}

    outputs = []
    for i in range(len(r["ttfts"])):
        outputs.append(
            RequestFuncOutput(
                generated_text=r["generated_texts"][i],
                success=r["errors"][i] == "",
                latency=r["latencies"][i],
                output_tokens=r["output_lens"][i],
                ttft=r["ttfts"][i],
                itl=r["itls"][i],
                prompt_len=r["input_lens"][i],
                error=r["errors"][i],
                start_time=r["start_times"][i],
                client_queue_time=r["queue_times"][i],
            )
        )
    m, output_lens = calculate_metrics([], outputs, r["duration"], None, percentiles, goodput)

    expected = {
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
        "output_lens": output_lens,
    }
    if goodput:
        expected["request_goodput"] = m.request_goodput
    for metric in ("ttft", "tpot", "itl", "e2el"):
        if f"mean_{metric}_ms" not in r:
            continue
        for stat in ("mean", "median", "std"):
            expected[f"{stat}_{metric}_ms"] = getattr(m, f"{stat}_{metric}_ms")
        for p, v in getattr(m, f"percentiles_{metric}_ms"):
            word = str(int(p)) if int(p) == p else str(p)
            expected[f"p{word}_{metric}_ms"] = v

    bad = 0
    for k, want in expected.items():
        got = r.get(k)
        if k in SKIPPED:
            print(f"  {k:<28} file {got}  vLLM 0.33 {want}  (not compared, see the docstring)")
            continue
        same = got == want if isinstance(want, list) else got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
        bad += not same
        if isinstance(want, list):
            print(f"  {k:<28} {'ok' if same else 'DIFFERS'} ({len(want)} values)")
        else:
            print(f"  {k:<28} file {got!s:<24} vLLM {want!s:<24} {'ok' if same else 'DIFFERS'}")
    print(f"{len(expected) - len(SKIPPED) - bad} figures agree, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
