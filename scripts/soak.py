"""Soak: mixed traffic with client aborts against a running mla-serve, then checks that it comes
back to idle with nothing leaked:

    python3 scripts/soak.py BASE_URL DURATION_S CONCURRENCY OUT_JSON [SERVER_PID] [MAX_TOKEN_ID]

CONCURRENCY clients each send requests back to back until DURATION_S: streamed and plain
completions (random token-id prompts of 1-2,000 tokens, up to 512 new tokens, some with n=2 or
4, a quarter with penalties and a banned token) and chats; a third of the streamed ones are
dropped by the client after a few chunks. Every 10 s it
samples /metrics (running, waiting, KV use), the server's resident memory (SERVER_PID) and the
GPUs' used memory (nvidia-smi, when present).

Pass: no request that was not dropped on purpose fails; within 60 s after the last client stops,
nothing is running or waiting and the KV cache is empty; resident and GPU memory at the end are
within 5% (GPU: 1%) of their value after the first minute, when the server has warmed up.
"""

import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request

base, duration, concurrency, out_path = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
pid = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] != "-" else None
max_id = int(sys.argv[6]) if len(sys.argv) > 6 else 30000
model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=30))["data"][0]["id"]
# Smaller requests try the script out (or hunt leaks with many more requests) on the CPU demo model.
max_prompt = int(os.environ.get("SOAK_MAX_PROMPT", "2000"))
max_new = int(os.environ.get("SOAK_MAX_TOKENS", "512"))
WORDS = "the of MLA latent cache rank GPU token expert router batch decode prefill".split()


def post(path, body):
    return urllib.request.Request(base + path, json.dumps(body).encode(), {"content-type": "application/json"})


def one(r):
    """One request; returns 'ok', 'dropped' or an error string."""
    kind = r.random()
    stream = kind < 0.6
    drop_after = r.randint(1, 20) if stream and r.random() < 1 / 3 else None
    if kind < 0.4 or kind >= 0.9:
        body = {"model": model, "prompt": [r.randrange(100, max_id) for _ in range(r.randint(1, max_prompt))],
                "max_tokens": r.randint(1, max_new), "ignore_eos": r.random() < 0.5, "temperature": r.choice([0, 0.8]),
                "stream": stream, "n": r.choice([2, 4]) if kind >= 0.9 else 1}
        if r.random() < 0.25:
            # Shaped draws: with speculation, their verify rows are shaped by the drafts before them.
            body.update(presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1,
                        logit_bias={str(r.randrange(100, max_id)): -100})
        req = post("/v1/completions", body)
    else:
        text = " ".join(r.choice(WORDS) for _ in range(r.randint(3, max(3, max_prompt // 5))))
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": r.randint(1, max(1, max_new // 2)),
                "temperature": 0.7, "stream": stream}
        req = post("/v1/chat/completions", body)
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            if not stream:
                json.loads(resp.read())
                return "ok"
            chunks = 0
            for line in resp:
                if line.startswith(b"data: [DONE]"):
                    return "ok"
                if line.startswith(b"data: "):
                    chunks += 1
                    if drop_after is not None and chunks >= drop_after:
                        return "dropped"  # leaving the with-block closes the connection mid-stream
            return "stream ended without [DONE]"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read()[:200]!r}"
    except Exception as e:  # noqa: BLE001 - any failure is a result here
        return repr(e)[:200]


counts = {"ok": 0, "dropped": 0}
failures = []
lock = threading.Lock()
deadline = time.time() + duration


def client(i):
    r = random.Random(i)
    while time.time() < deadline:
        res = one(r)
        with lock:
            if res in counts:
                counts[res] += 1
            else:
                failures.append(res)


def metrics():
    out = {}
    for line in urllib.request.urlopen(base + "/metrics", timeout=10).read().decode().splitlines():
        if line.startswith("mla:") and "{" in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            if name in ("mla:num_requests_running", "mla:num_requests_waiting", "mla:kv_cache_usage_perc"):
                out[name] = out.get(name, 0.0) + value
    return out


def rss_mib():
    if pid is None:
        return None
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def gpu_mib():
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        return [float(x) for x in q.stdout.split()] if q.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


samples = []


def sample(t0):
    samples.append({"t": round(time.time() - t0, 1), **metrics(), "rss_mib": rss_mib(), "gpu_mib": gpu_mib(),
                    "ok": counts["ok"], "dropped": counts["dropped"], "failed": len(failures)})


t0 = time.time()
threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
[t.start() for t in threads]
while any(t.is_alive() for t in threads):
    time.sleep(10)
    sample(t0)
    s = samples[-1]
    print(f"t+{s['t']:.0f}s running {s.get('mla:num_requests_running')} waiting {s.get('mla:num_requests_waiting')} "
          f"kv {s.get('mla:kv_cache_usage_perc', 0):.3f} ok {s['ok']} dropped {s['dropped']} failed {s['failed']} "
          f"rss {s['rss_mib']} MiB gpu {s['gpu_mib']}", flush=True)
idle = None
for _ in range(60):
    m = metrics()
    if not m.get("mla:num_requests_running") and not m.get("mla:num_requests_waiting") and not m.get("mla:kv_cache_usage_perc"):
        idle = round(time.time() - t0 - duration, 1)
        break
    time.sleep(1)
sample(t0)
warm = next((s for s in samples if s["t"] >= 60), samples[0])
end = samples[-1]
rss_ok = warm["rss_mib"] is None or end["rss_mib"] <= 1.05 * warm["rss_mib"]
gpu_ok = warm["gpu_mib"] is None or all(e <= 1.01 * w for e, w in zip(end["gpu_mib"], warm["gpu_mib"]))
passed = not failures and idle is not None and rss_ok and gpu_ok
summary = {"duration_s": duration, "concurrency": concurrency, "completed": counts["ok"], "dropped": counts["dropped"],
           "failed": len(failures), "first_failures": failures[:5], "idle_after_s": idle,
           "rss_mib_warm_end": [warm["rss_mib"], end["rss_mib"]], "gpu_mib_warm_end": [warm["gpu_mib"], end["gpu_mib"]],
           "passed": passed, "samples": samples}
json.dump(summary, open(out_path, "w"), indent=1)
print(f"summary: {counts['ok']} completed, {counts['dropped']} dropped by the client, {len(failures)} failed "
      f"{failures[:2]}; idle {idle} s after the clients stopped; RSS {warm['rss_mib']} -> {end['rss_mib']} MiB; "
      f"GPU {warm['gpu_mib']} -> {end['gpu_mib']} MiB")
print("summary: passed" if passed else "summary: FAILED")
sys.exit(0 if passed else 1)
