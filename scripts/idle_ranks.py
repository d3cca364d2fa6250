"""Idle ranks: a DP-attention server (`--tp N --enable-dp-attention`) mostly has one request at a
time, so every step but one rank's is an idle batch that still joins each collective. This sends
one streamed request at a time with random prompt and output lengths for DURATION seconds, then
bursts of concurrent requests with idle gaps between them, and checks that nothing hangs:

    python3 scripts/idle_ranks.py BASE_URL DURATION_S OUT_JSON [MAX_TOKEN_ID]

Pass: every request completes (200, [DONE], the asked number of tokens), and in the one-at-a-time
phase no gap between two streamed tokens (a decode step, as the client sees it) is longer than
10x the median gap. Prefill steps show up as the time to the first token and are reported, not
judged: a 2,000-token prefill is many decode steps long. In bursts, gaps include other requests'
prefill chunks, so they are reported only.
"""

import concurrent.futures
import json
import os
import random
import statistics
import sys
import time
import urllib.request

base, duration, out_path = sys.argv[1], float(sys.argv[2]), sys.argv[3]
# Prompts are random token ids below this (the V2-Lite shape's vocabulary by default).
max_id = int(sys.argv[4]) if len(sys.argv) > 4 else 30000
# Smaller settings try the script out against the CPU demo model.
max_prompt = int(os.environ.get("IDLE_MAX_PROMPT", "2000"))
max_output = int(os.environ.get("IDLE_MAX_OUTPUT", "300"))
burst_sizes = [int(x) for x in os.environ.get("IDLE_BURSTS", "8,64,256,32,128").split(",")]
rng = random.Random(7)
model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=30))["data"][0]["id"]


def one(prompt_len, max_tokens, seed):
    """One streamed completion: (ok, error, time to first token, gaps between later tokens)."""
    r = random.Random(seed)
    body = {
        "model": model,
        "prompt": [r.randrange(min(100, max_id // 2), max_id) for _ in range(prompt_len)],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    t0 = time.perf_counter()
    arrivals, done = [], False
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    arrivals.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - any failure is a result here
        return False, repr(e)[:200], None, []
    if not done:
        return False, "stream ended without [DONE]", None, []
    ttft = arrivals[0] - t0 if arrivals else None
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return True, None, ttft, gaps


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else None


# Phase 1: one request at a time.
serial = {"requests": 0, "failed": [], "ttft": [], "gaps": []}
t_end = time.time() + duration
i = 0
while time.time() < t_end:
    ok, err, ttft, gaps = one(rng.randint(1, max_prompt), rng.randint(1, max_output), i)
    serial["requests"] += 1
    if not ok:
        serial["failed"].append(err)
    else:
        serial["ttft"].append(ttft)
        serial["gaps"].extend(gaps)
    i += 1

# Phase 2: bursts of 8..256 concurrent requests, a few seconds of idle between them.
bursts = []
for size in burst_sizes:
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(one, rng.randint(1, max_prompt), rng.randint(1, max_output), 10_000 + i + k) for k in range(size)]
        results = [f.result() for f in futures]
    i += size
    failed = [r[1] for r in results if not r[0]]
    gaps = [g for r in results for g in r[3]]
    bursts.append({"size": size, "seconds": round(time.time() - t0, 2), "failed": failed,
                   "gap_ms_median": 1e3 * statistics.median(gaps) if gaps else None,
                   "gap_ms_max": 1e3 * max(gaps) if gaps else None})
    time.sleep(rng.uniform(1, 5))

gaps = serial["gaps"]
median = statistics.median(gaps) if gaps else 0.0
worst = max(gaps) if gaps else 0.0
summary = {
    "duration_s": duration,
    "serial_requests": serial["requests"],
    "serial_failed": serial["failed"][:5],
    "serial_tokens": len(gaps) + len(serial["ttft"]),
    "gap_ms": {"median": 1e3 * median, "p99": 1e3 * (pct(gaps, 99) or 0), "p999": 1e3 * (pct(gaps, 99.9) or 0),
               "max": 1e3 * worst, "max_over_median": worst / median if median else None},
    "ttft_ms": {"median": 1e3 * statistics.median(serial["ttft"]) if serial["ttft"] else None,
                "max": 1e3 * max(serial["ttft"]) if serial["ttft"] else None},
    "bursts": bursts,
}
passed = not serial["failed"] and all(not b["failed"] for b in bursts) and median > 0 and worst <= 10 * median
summary["passed"] = passed
json.dump(summary, open(out_path, "w"), indent=1)
print(f"summary: {serial['requests']} serial requests, {len(serial['failed'])} failed; token gaps median "
      f"{1e3 * median:.2f} ms, p99.9 {summary['gap_ms']['p999']:.2f} ms, max {1e3 * worst:.2f} ms "
      f"({summary['gap_ms']['max_over_median'] or 0:.1f}x median); TTFT median {summary['ttft_ms']['median'] or 0:.1f} ms")
for b in bursts:
    print(f"summary: burst of {b['size']}: {b['seconds']} s, {len(b['failed'])} failed, gap median "
          f"{b['gap_ms_median'] or 0:.2f} ms, max {b['gap_ms_max'] or 0:.1f} ms")
print("summary: passed" if passed else "summary: FAILED")
sys.exit(0 if passed else 1)
