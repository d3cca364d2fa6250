"""Teacher-forced log-probabilities through a running server, and their comparison between two
runs (FP8 weights against bf16, one layout against another).

    python3 scripts/teacher_forced.py dump BASE_URL OUT_JSON [PROMPTS] [LENGTH] [MAX_TOKEN_ID]
    python3 scripts/teacher_forced.py compare REFERENCE_JSON OTHER_JSON [--max-p99 X] [--min-top1 Y]
    python3 scripts/teacher_forced.py noise REF_1 OTHER_1 REF_2 OTHER_2 ...

`dump` sends PROMPTS (16) seeded token-id prompts of LENGTH (256) tokens with
`prompt_logprobs: 1` and records, at every position, the log-probability of the prompt's own next
token and the model's top-1 token: the model's view of the same text, free of sampling, so two
runs compare position by position. `compare` prints the mean, p99 and max |Δ logprob| and the
top-1 agreement, and fails (exit 1) when the p99 or the agreement is outside the bounds given.
`noise` compares each pair (FP8 against bf16 in several layouts, say) and fails when one pair's
p99 is more than NOISE_SPREAD times another's: the quantization noise must not depend on the
layout, while a layout that computed something else would stand out.
"""

import json
import random
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def dump(base, out, count=16, length=256, max_id=30000):
    model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=30))["data"][0]["id"]
    rng = random.Random(1234)
    prompts = [[rng.randrange(100, max_id) for _ in range(length)] for _ in range(count)]

    def one(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
        req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            entries = json.load(r)["choices"][0]["prompt_logprobs"]
        chosen, top1 = [], []
        for pos, e in enumerate(entries[1:], start=1):
            chosen.append(e[str(prompt[pos])]["logprob"])
            top1.append(int(next(k for k, v in e.items() if v["rank"] == 1)))
        return {"chosen": chosen, "top1": top1}

    with ThreadPoolExecutor(8) as pool:
        rows = list(pool.map(one, prompts))
    json.dump({"model": model, "length": length, "rows": rows}, open(out, "w"))
    print(f"{out}: {count} prompts of {length} tokens")


NOISE_SPREAD = 1.5


def stats(ref_path, other_path):
    ref, other = json.load(open(ref_path)), json.load(open(other_path))
    deltas, same, total = [], 0, 0
    for a, b in zip(ref["rows"], other["rows"]):
        deltas += [abs(x - y) for x, y in zip(a["chosen"], b["chosen"])]
        same += sum(x == y for x, y in zip(a["top1"], b["top1"]))
        total += len(a["top1"])
    deltas.sort()
    return {
        "reference": ref_path,
        "other": other_path,
        "positions": len(deltas),
        "mean_abs_delta": sum(deltas) / len(deltas),
        "p99_abs_delta": deltas[min(len(deltas) - 1, int(0.99 * len(deltas)))],
        "max_abs_delta": deltas[-1],
        "top1_agreement": same / total,
    }


def noise(paths):
    rows = [stats(a, b) for a, b in zip(paths[::2], paths[1::2])]
    for r in rows:
        print(json.dumps(r))
    p99 = [r["p99_abs_delta"] for r in rows]
    spread = max(p99) / max(min(p99), 1e-9)
    print(json.dumps({"p99_spread": spread, "limit": NOISE_SPREAD}))
    return spread <= NOISE_SPREAD


def compare(ref_path, other_path, max_p99=None, min_top1=None):
    summary = stats(ref_path, other_path)
    print(json.dumps(summary))
    return (max_p99 is None or summary["p99_abs_delta"] <= max_p99) and (
        min_top1 is None or summary["top1_agreement"] >= min_top1
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "dump" and len(args) >= 3:
        dump(args[1], args[2], *(int(x) for x in args[3:6]))
    elif args and args[0] == "noise" and len(args) >= 5 and len(args) % 2 == 1:
        sys.exit(0 if noise(args[1:]) else 1)
    elif args and args[0] == "compare" and len(args) >= 3:
        opts = dict(zip(args[3::2], args[4::2]))
        ok = compare(args[1], args[2], float(opts["--max-p99"]) if "--max-p99" in opts else None,
                     float(opts["--min-top1"]) if "--min-top1" in opts else None)
        sys.exit(0 if ok else 1)
    else:
        sys.exit(__doc__)
