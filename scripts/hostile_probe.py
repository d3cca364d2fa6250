#!/usr/bin/env python3
"""The hostile-client probes of issue 14 against a running mla-serve, with normal traffic
measured alongside each: records what every hostile request got and normal requests' latency
and /health's, as JSON (with date, commit and command) and a table on stdout.

    scripts/hostile_probe.py --url http://127.0.0.1:8000 --out probe.json [--model NAME]

The probes live in tests/e2e/hostile.py, shared with the end-to-end test that checks the
factor. The server's own flags (keep-alive, body timeout) must be passed here too, so the
connection probe knows how long to wait: --keep-alive and --body-timeout.
"""

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
import hostile  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep-alive", type=float, default=10.0, help="the server's --timeout-keep-alive")
    ap.add_argument("--body-timeout", type=float, default=30.0, help="the server's --body-read-timeout")
    ap.add_argument("--idle-connections", type=int, default=1100)
    ap.add_argument("--seconds", type=float, default=5.0, help="normal traffic measured per phase at least")
    args = ap.parse_args()
    base = args.url.rstrip("/")
    url = urlparse(base)
    model = args.model or hostile_first_model(base)

    phases = {
        "unloaded": None,
        "64 stop strings of 1 KB, 2 streams": lambda: hostile.many_long_stop_strings(base, model),
        "31 MB prompt string and id list; 1 MB ones": lambda: hostile.huge_prompts(base, model),
        "prompts x n over the batch, 2000 prompts, bad tool_calls, form POST": lambda: hostile.request_shapes(
            base, model),
        f"{args.idle_connections} idle connections, slow head, slow body": lambda: hostile.idle_and_slow_connections(
            url.hostname, url.port, args.idle_connections, args.keep_alive, args.body_timeout),
    }

    connections = (url.hostname, url.port, args.idle_connections, args.keep_alive, args.body_timeout)

    async def everything_at_once():
        # The connection flood runs in its own process: in this one it would starve the other
        # probes' event loop, and a request head sent late would be the client's fault.
        with concurrent.futures.ProcessPoolExecutor(1) as pool:
            flood = asyncio.get_running_loop().run_in_executor(pool, connection_probe, *connections)
            others = asyncio.gather(*(probe() for probe in list(phases.values())[1:4]))
            results = await others
            return dict(zip(["stops", "prompts", "shapes", "connections"], [*results, await flood]))

    phases["all of the above at once"] = everything_at_once
    results = []
    for name, probe in phases.items():
        normal, got = asyncio.run(hostile.measure_during(base, model, probe, min_seconds=args.seconds))
        results.append({"phase": name, "normal": normal, "hostile": got})
        print(f"{name:70s} p50 {fmt(normal['p50_ms'])} p95 {fmt(normal['p95_ms'])} "
              f"health max {fmt(normal['health_max_ms'])} normal failed {len(normal['failed'])}")
    baseline = results[0]["normal"]["p50_ms"]
    for r in results[1:]:
        r["p50_over_unloaded"] = round(r["normal"]["p50_ms"] / baseline, 2) if baseline else None
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "command": " ".join(sys.argv),
        "server": base,
        "model": model,
        "phases": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps([{r["phase"]: r["hostile"]} for r in results[1:]], indent=1))
    return 0


def connection_probe(*args) -> dict:
    return asyncio.run(hostile.idle_and_slow_connections(*args))


def hostile_first_model(base: str) -> str:
    import httpx

    return httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]


def fmt(ms) -> str:
    return f"{ms:7.1f} ms" if ms is not None else "      -   "


def git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
