#!/usr/bin/env python3
"""What an n-way request costs a running server, and the normal traffic beside it: one prompt of
`--prompt-len` ids with `n` of 1 and `--n` choices, with and without prompt logprobs (the
hostile-requests test's amplifier, tests/e2e/hostile.py), each timed `--reps` times; then normal
chats' latency while the n-way request with prompt logprobs runs, against the idle server's.
Writes JSON (date, commit, command, binary) and prints a table.

    scripts/n_way_probe.py --bin target/debug/mla-serve --out n_way.json [--prompt-len 1000 --n 64]
        [--model-name NAME -- SERVER FLAGS]

The server is started here (the e2e suite's `Server`) with the demo model, or with the flags
after `--` (a GPU model, whose served name `--model-name` gives), so runs of two binaries on one
machine compare.
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from probe_server import add_server_args, start_server  # noqa: E402  (beside this script)
from run_envelope import envelope  # noqa: E402  (beside this script)
import hostile  # noqa: E402


def timed(client: httpx.Client, body: dict) -> float:
    t = time.perf_counter()
    r = client.post("/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    add_server_args(ap)
    args = ap.parse_args()
    model = args.model_name
    server = start_server(args)
    out = envelope(binary=args.bin, server_flags=args.flags, prompt_len=args.prompt_len, requests_s={}, normal_traffic=[])
    try:
        with httpx.Client(base_url=server.base, timeout=120) as c:
            for n in (1, args.n):
                for plp in (None, 20):
                    body = {"model": model, "prompt": [11] * args.prompt_len, "max_tokens": 1, "n": n}
                    if plp:
                        body["prompt_logprobs"] = plp
                    # The first of each kind warms the prefix cache; prompt logprobs never use it.
                    samples = [round(timed(c, body), 3) for _ in range(args.reps + 1)]
                    out["requests_s"][f"n{n}" + ("_plp20" if plp else "")] = {"samples": samples, "median_warm": statistics.median(samples[1:])}
        for _ in range(args.reps):
            idle, _ = asyncio.run(hostile.measure_during(server.base, model, None))
            loaded, got = asyncio.run(hostile.measure_during(
                server.base, model, lambda: hostile.prompt_logprobs_amplifier(server.base, model, args.prompt_len, args.n)))
            out["normal_traffic"].append({
                "idle_p50_ms": round(idle["p50_ms"], 1),
                "loaded_p50_ms": round(loaded["p50_ms"], 1),
                "loaded_p95_ms": round(loaded["p95_ms"], 1),
                "loaded_requests": loaded["requests"],
                "amplifier_s": {k: v["seconds"] for k, v in got.items()},
            })
    finally:
        server.stop()
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for k, v in out["requests_s"].items():
        print(f"{k:>12}: {v['median_warm']:.3f} s  {v['samples']}")
    for t in out["normal_traffic"]:
        print(f"normal p50 idle {t['idle_p50_ms']} ms, beside n={args.n} with prompt logprobs {t['loaded_p50_ms']} ms (p95 {t['loaded_p95_ms']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
