#!/usr/bin/env python3
"""Compares the router stage's runs (scripts/gpu_multi_run.sh router): in each multi-rank mode,
--router-policy prefix against least-loaded on the same workloads, and the multi-turn hit rate
against one GPU's. Prints a table and the issue's bar, writes router-summary.json beside the
runs, and exits 1 when a run is missing, a request failed or the bar is not met:

  - multi-turn hit rate (prefix) within 10% of one GPU's (relative);
  - multi-turn turn-8 TTFT p50: least-loaded's at least 2x prefix's;
  - output throughput of prefix not lower than least-loaded's (multi-turn, shared prefix);
  - random prompts (nothing shared): prefix's output throughput not lower.

"Not lower" allows 3% of run-to-run noise. Usage: router_compare.py RESULTS_DIR
"""

import json
import sys
from pathlib import Path

NOISE = 0.03
MODES = ("replicas", "dpa")
BENCHES = ("multiturn", "shared", "random")


def metrics(out: Path, name: str):
    path = out / f"{name}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())["results"]["metrics"]


def turn8_ttft(m) -> float:
    turns = m.get("ttft_by_turn") or []
    return turns[7]["median_ms"] if len(turns) >= 8 else float("nan")


def main(out: Path) -> int:
    failures = []
    single = metrics(out, "router-single-multiturn")
    if single is None:
        failures.append("router-single-multiturn.json missing")
    summary = {"single_multiturn_hit_rate": single and single["prefix_cache_hit_rate"], "modes": {}}
    print(f"{'run':<34} {'hit rate':>8} {'turn-8 TTFT p50':>16} {'output tok/s':>13} {'failed':>6}")
    if single:
        print(f"{'single multiturn':<34} {single['prefix_cache_hit_rate']:>8.3f} {turn8_ttft(single):>13.1f} ms "
              f"{single['output_throughput']:>13.0f} {single['failed']:>6}")
    for mode in MODES:
        runs = {}
        for policy in ("prefix", "least-loaded"):
            for bench in BENCHES:
                name = f"router-{mode}-{policy}-{bench}"
                m = metrics(out, name)
                if m is None:
                    failures.append(f"{name}.json missing")
                    continue
                runs[(policy, bench)] = m
                if m["failed"]:
                    failures.append(f"{name}: {m['failed']} failed requests")
                ttft = f"{turn8_ttft(m):>13.1f} ms" if bench == "multiturn" else f"{'':>16}"
                print(f"{mode + ' ' + policy + ' ' + bench:<34} {m['prefix_cache_hit_rate']:>8.3f} {ttft} "
                      f"{m['output_throughput']:>13.0f} {m['failed']:>6}")
        checks = {}
        p, ll = runs.get(("prefix", "multiturn")), runs.get(("least-loaded", "multiturn"))
        if p and single:
            ratio = p["prefix_cache_hit_rate"] / max(single["prefix_cache_hit_rate"], 1e-9)
            checks["multiturn hit rate within 10% of one GPU's"] = (ratio >= 0.9, f"{ratio:.3f}x one GPU's")
        if p and ll:
            speedup = turn8_ttft(ll) / max(turn8_ttft(p), 1e-9)
            checks["multiturn turn-8 TTFT p50 >= 2x better"] = (speedup >= 2.0, f"{speedup:.2f}x")
        for bench in BENCHES:
            a, b = runs.get(("prefix", bench)), runs.get(("least-loaded", bench))
            if a and b:
                ratio = a["output_throughput"] / max(b["output_throughput"], 1e-9)
                checks[f"{bench} output throughput not lower"] = (ratio >= 1 - NOISE, f"{ratio:.3f}x")
        print(f"{mode}:")
        for what, (ok, figure) in checks.items():
            print(f"  {'ok  ' if ok else 'FAIL'} {what}: {figure}")
            if not ok:
                failures.append(f"{mode}: {what} ({figure})")
        summary["modes"][mode] = {
            "runs": {f"{pol}-{bench}": {"hit_rate": m["prefix_cache_hit_rate"], "turn8_ttft_p50_ms": turn8_ttft(m),
                                        "output_throughput": m["output_throughput"], "failed": m["failed"]}
                     for (pol, bench), m in runs.items()},
            "checks": {what: {"ok": ok, "figure": figure} for what, (ok, figure) in checks.items()},
        }
    summary["failures"] = failures
    (out / "router-summary.json").write_text(json.dumps(summary, indent=1, allow_nan=True) + "\n")
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
