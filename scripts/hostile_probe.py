#!/usr/bin/env python3
"""The hostile-client probes of issues 14 and 25 against a running mla-serve, with normal traffic
measured alongside each: records what every hostile request got and normal requests' latency
and /health's, as JSON (with date, commit and command) and a table on stdout.

    scripts/hostile_probe.py --url http://127.0.0.1:8000 --out probe.json [--model NAME]

The probes live in tests/e2e/hostile.py, shared with the end-to-end test that checks the
factor. The server's own flags (keep-alive, body timeout) must be passed here too, so the
connection probe knows how long to wait: --keep-alive and --body-timeout. With the server's
--max-connections passed as --max-connections, a last phase floods past it (without normal
traffic, whose new connections would be refused too) and asks /health over a connection opened
before the flood.

Every request and socket has a timeout and the whole run stops at --budget seconds (360: the
phases take about 220 s with the server's default timeouts on the demo model, issue 25's prompt
logprobs of 4000 ids with n 128 about 50 s of that); a phase cut off is recorded so.
"""

import argparse
import asyncio
import concurrent.futures
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
import hostile  # noqa: E402
from run_envelope import envelope  # noqa: E402  (beside this script)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep-alive", type=float, default=10.0, help="the server's --timeout-keep-alive")
    ap.add_argument("--body-timeout", type=float, default=30.0, help="the server's --body-read-timeout")
    ap.add_argument("--idle-connections", type=int, default=1100)
    ap.add_argument("--seconds", type=float, default=5.0, help="normal traffic measured per phase at least")
    ap.add_argument("--max-connections", type=int, default=None,
                    help="the server's --max-connections: adds a phase that floods past it")
    ap.add_argument("--budget", type=float, default=360.0, help="seconds the whole run may take")
    ap.add_argument("--pid", type=int, default=None, help="the server's process id, when it runs here: "
                    "its resident memory is recorded after the issue-25 phases")
    ap.add_argument("--grammar-clients", type=int, default=32)
    ap.add_argument("--grammar-seconds", type=float, default=30.0)
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget
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

    # Issue 25's requests; the server's memory is read when it runs here (--pid).
    phases.update({
        "$ref and Lark chains, grammars allowing no output (issue 25)": lambda: hostile.post_each(
            base, hostile.deep_and_empty_grammar_bodies(model), args.pid),
        f"{args.grammar_clients} clients of expensive grammars for {args.grammar_seconds:.0f} s": lambda: (
            hostile.expensive_grammar_clients(base, model, args.grammar_clients, args.grammar_seconds)),
        "prompt_logprobs 20 of 4000 ids with n 128, and echo": lambda: hostile.prompt_logprobs_amplifier(
            base, model, 4000, 128),
        "32 /tokenize bodies of 1 MiB": lambda: hostile.tokenize_bodies(base, 32, args.pid),
    })

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
        left = deadline - time.monotonic()
        if left <= 0:
            results.append({"phase": name, "skipped": f"the {args.budget:.0f} s budget was spent"})
            continue
        try:
            normal, got = asyncio.run(asyncio.wait_for(
                hostile.measure_during(base, model, probe, min_seconds=args.seconds), timeout=left))
        except asyncio.TimeoutError:
            results.append({"phase": name, "skipped": f"cut off at the {args.budget:.0f} s budget"})
            continue
        results.append({"phase": name, "normal": normal, "hostile": got})
    if args.max_connections is not None:
        flood = max(args.idle_connections, args.max_connections + 100)
        name = f"{flood} connections over --max-connections {args.max_connections} (no normal traffic)"
        left = deadline - time.monotonic()
        try:
            got = asyncio.run(asyncio.wait_for(
                hostile.flood_over_the_cap(base, url.hostname, url.port, flood, args.keep_alive), timeout=max(left, 0)))
            results.append({"phase": name, "hostile": got})
        except asyncio.TimeoutError:
            results.append({"phase": name, "skipped": f"cut off at the {args.budget:.0f} s budget"})

    baseline = results[0].get("normal", {}).get("p50_ms")
    for r in results[1:]:
        if baseline and r.get("normal", {}).get("p50_ms"):
            r["p50_over_unloaded"] = round(r["normal"]["p50_ms"] / baseline, 2)
    print_table(results)
    record = envelope(server=base, model=model, phases=results)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


def print_table(results: list):
    """Normal traffic per phase, then what each hostile request got."""
    print(f"{'phase':72s} {'normal p50':>10s} {'p95':>10s} {'x unloaded':>10s} {'/health max':>11s} failed")
    for r in results:
        n = r.get("normal")
        if n is None:
            print(f"{r['phase'][:72]:72s} {r.get('skipped', '(no normal traffic)')}")
            continue
        ratio = r.get("p50_over_unloaded")
        print(f"{r['phase'][:72]:72s} {fmt(n['p50_ms'])} {fmt(n['p95_ms'])} {ratio if ratio else '':>10} "
              f"{fmt(n['health_max_ms']):>11s} {len(n['failed']) + len(n['health_not_200'])}")
    print()
    for r in results:
        if r.get("hostile"):
            print(r["phase"])
            for line in hostile_lines(r["hostile"]):
                print("   ", line)


def hostile_lines(got: dict, path: str = ""):
    """One line per hostile HTTP request (status, seconds, error code, Retry-After) and one per
    connection probe (its counts and close times)."""
    if "status" in got:
        code = f" {got['code']}" if got.get("code") else ""
        retry = f", Retry-After {got['retry_after']}" if got.get("retry_after") else ""
        error = f" ({got['error']})" if got.get("error") else ""
        yield f"{path}: {got['status']}{code} in {got.get('seconds', '?')} s{retry}{error}"
        return
    nested = lambda v: isinstance(v, dict) or (isinstance(v, list) and any(isinstance(x, dict) for x in v))  # noqa: E731
    plain = {k: v for k, v in got.items() if not nested(v)}
    if plain:
        yield (f"{path}: " if path else "") + ", ".join(f"{k} {v}" for k, v in plain.items())
    for k, v in got.items():
        where = f"{path}.{k}" if path else k
        if isinstance(v, dict):
            yield from hostile_lines(v, where)
        elif nested(v):
            for i, x in enumerate(v):
                yield from hostile_lines(x, f"{where}[{i}]")


def connection_probe(*args) -> dict:
    return asyncio.run(hostile.idle_and_slow_connections(*args))


def hostile_first_model(base: str) -> str:
    import httpx

    return httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]


def fmt(ms) -> str:
    return f"{ms:7.1f} ms" if ms is not None else "      -   "


if __name__ == "__main__":
    sys.exit(main())
