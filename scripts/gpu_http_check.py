# Concurrent chat requests against a running mla-serve (V2-Lite shape, dummy weights, --device cuda).
# Used in H200 run 2 (docs/runs/2026-11-22.md):
#   mla-serve --model deepseek-v2-lite --load-format dummy --device cuda --tokenizer assets/demo \
#       --port 8123 --max-num-seqs 64 --gpu-memory-utilization 0.5 &
#   python3 scripts/gpu_http_check.py http://127.0.0.1:8123 48
import json, sys, threading, time, urllib.request

base = sys.argv[1]
n = int(sys.argv[2])
# The served model's name, whatever the server was started with.
model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=30))["data"][0]["id"]
results = [None] * n

def chat(i, stream=False):
    body = {"model": model, "messages": [{"role": "user", "content": f"request {i}: say something"}],
            "max_tokens": 24 + i % 9, "temperature": [0.0, 0.7, 1.0][i % 3], "top_p": 0.9, "seed": i, "stream": stream}
    if i % 4 == 1:
        body["logprobs"] = True
        body["top_logprobs"] = 3
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t = time.time()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read().decode()
            if stream:
                chunks = [l[6:] for l in raw.splitlines() if l.startswith("data: ")]
                ok = chunks and chunks[-1] == "[DONE]"
                results[i] = (r.status, ok, len(chunks), time.time() - t)
            else:
                j = json.loads(raw)
                results[i] = (r.status, j["choices"][0]["finish_reason"], j["usage"]["completion_tokens"], time.time() - t)
    except Exception as e:
        results[i] = ("error", repr(e)[:200], 0, time.time() - t)

threads = [threading.Thread(target=chat, args=(i, i % 8 == 7)) for i in range(n)]
t0 = time.time()
[t.start() for t in threads]
[t.join() for t in threads]
wall = time.time() - t0
good = sum(1 for r in results if r[0] == 200 and r[1] not in (False,))
print(f"{good}/{n} requests answered 200 in {wall:.2f}s wall")
for i, r in enumerate(results[:6]):
    print(i, r)
bad = [r for r in results if r[0] != 200 or r[1] is False]
print("failures:", bad[:5])
sys.exit(0 if not bad else 1)
