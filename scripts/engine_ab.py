#!/usr/bin/env python3
"""Before/after engine figures from folders of `scripts/gpu_multi_run.sh ... engine-MODE` runs named
PREFIX-old-N and PREFIX-new-N (run alternately, old new new old ..., on the same GPUs): prefill and
decode throughput of each side, its spread, and new/old. Prints a Markdown table.

  scripts/engine_ab.py RESULTS_DIR [PREFIX ...]     (default prefixes: eng1 engtp)
"""
import glob
import json
import statistics
import sys
from pathlib import Path


def figures(path: Path) -> dict:
    r = json.loads(path.read_text())["results"]
    out = {"prefill tok/s": r["prefill"]["tokens_per_s"]}
    for d in r["decode"]:
        out[f"decode B={d['batch']} ctx={d['context']} tok/s"] = d["tokens_per_s"]
    return out


def main(root: Path, prefixes: list) -> int:
    for prefix in prefixes:
        sides = {}
        for side in ("old", "new"):
            runs = [figures(Path(f)) for d in sorted(glob.glob(str(root / f"{prefix}-{side}-*")))
                    for f in glob.glob(d + "/engine-*.json")]
            sides[side] = runs
        if not sides["old"] or not sides["new"]:
            print(f"{prefix}: no runs")
            continue
        commit = {s: json.loads(Path(glob.glob(str(root / f"{prefix}-{s}-0/engine-*.json"))[0]).read_text())
                  ["git_commit"] for s in ("old", "new")}
        print(f"\n{prefix}: {len(sides['old'])} runs each, old {commit['old']}, new {commit['new']}\n")
        print("| figure | old (mean, min-max) | new (mean, min-max) | new/old |")
        print("|---|---|---|---|")
        for key in sides["old"][0]:
            o = [r[key] for r in sides["old"]]
            n = [r[key] for r in sides["new"]]
            mo, mn = statistics.mean(o), statistics.mean(n)
            print(f"| {key} | {mo:,.0f} ({min(o):,.0f}-{max(o):,.0f}) | {mn:,.0f} ({min(n):,.0f}-{max(n):,.0f}) "
                  f"| {mn / mo:.3f} |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:] or ["eng1", "engtp"]))
