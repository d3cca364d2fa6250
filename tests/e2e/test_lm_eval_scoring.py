"""lm-evaluation-harness's `local-completions` loglikelihood requests, scored against HF
transformers.

lm-eval (lm_eval/models/openai_completions.py) sends every request of a batch as one
/v1/completions call: `prompt` a list of token-id lists (context + continuation), `echo: true`,
`logprobs: 1`, `max_tokens: 1`, `temperature: 0`, `seed`; it reads, per choice sorted by index,
`token_logprobs[ctxlen:-1]` (summed) and `top_logprobs[ctxlen:-1]` (greedy when each token's
logprob is the largest of its object). This test sends exactly that and applies exactly that
parse, then checks every prompt logprob against HF's own: the fixtures' `oracle_f32.safetensors`
hold HF's float32 logits for every position of prompt + greedy continuation (made by
scripts/make_fixtures.py), and the reference is their log-softmax, computed here in Python.
"""

import json
import math
import shutil
import struct
from array import array
from operator import itemgetter

import pytest
import requests

from server import ROOT, Server

FIXTURES = ROOT / "tests" / "fixtures"
DEMO = ROOT / "assets" / "demo"
# The CPU backend computes in f32 like HF's oracle run; sums over ~40 tokens stay within this.
TOLERANCE = 2e-3


def hf_logits(variant):
    """{prompt name: rows of 512 logits}, read from the safetensors file without libraries."""
    data = (FIXTURES / variant / "oracle_f32.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32"
        start, end = t["data_offsets"]
        values = array("f", data[8 + n + start : 8 + n + end])
        rows, cols = t["shape"]
        out[name] = [values[r * cols : (r + 1) * cols] for r in range(rows)]
    return out


def log_softmax(row):
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def parse_logprobs(out, ctxlens):
    """lm-eval's LocalCompletionsAPI.parse_logprobs, as written there."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        assert ctxlen > 0
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = True
        for tok, top in zip(tokens_logprobs, top_logprobs):
            if tok != max(top.values()):
                is_greedy = False
                break
        res.append((logprobs, is_greedy))
    return res


# The prompt rows are scored on each attention rank where they are computed
# (`LogitsRequest::Scored`): tensor-parallel ranks and DP-attention ranks score alike.
LAYOUTS = {"one-rank": [], "tensor-parallel": ["--tp", "2"], "dp-attention": ["--tp", "2", "--enable-dp-attention"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
def test_lm_eval_loglikelihood_matches_hf(variant, layout, tmp_path):
    src = FIXTURES / variant
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(src / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, tmp_path / name)
    oracle = json.loads((src / "oracle.json").read_text())
    logits = hf_logits(variant)
    # A small step budget: the prompts are scored across several prefill chunks.
    server = Server("--model", str(tmp_path), "--device", "cpu", "--served-model-name", variant,
                    "--max-num-batched-tokens", "24", *LAYOUTS[layout])
    try:
        prompts = oracle["prompts"]
        sequences = [p["prompt"] + p["continuation"] for p in prompts]
        payload = {
            "model": variant,
            "prompt": sequences,
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        r = requests.post(server.base + "/v1/completions", json=payload, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        choices = sorted(out["choices"], key=itemgetter("index"))
        for p, seq, choice in zip(prompts, sequences, choices):
            lp = choice["logprobs"]
            # Every prompt token, then the one generated token.
            assert len(lp["token_logprobs"]) == len(seq) + 1
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            rows = logits[p["name"]]
            assert len(rows) == len(seq)
            for i in range(1, len(seq)):
                want = log_softmax(rows[i - 1])[seq[i]]
                assert lp["token_logprobs"][i] == pytest.approx(want, abs=TOLERANCE), f"{p['name']} token {i}"
                assert len(lp["top_logprobs"][i]) in (1, 2)
        scored = parse_logprobs(out, [len(p["prompt"]) for p in prompts])
        for p, seq, (total, greedy) in zip(prompts, sequences, scored):
            rows = logits[p["name"]]
            ctx = len(p["prompt"])
            want = sum(log_softmax(rows[i - 1])[seq[i]] for i in range(ctx, len(seq)))
            assert total == pytest.approx(want, abs=TOLERANCE * len(seq))
            # The continuation is HF's greedy one: greedy here too unless a step is a near-tie
            # (top-2 logit gap below 1e-3, as test_hf_fixtures.py allows).
            if min(p["gaps"]) >= 1e-3:
                assert greedy, p["name"]

        # Again, with the prefix cache now holding these prompts: the prompts are recomputed (a
        # cached block has no logits), and the answer is the same.
        again = requests.post(server.base + "/v1/completions", json=payload, timeout=300).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        plain = {k: v for k, v in payload.items() if k not in ("echo", "logprobs")}
        warm = requests.post(server.base + "/v1/completions", json=plain, timeout=300).json()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the cache was warm"
        for whole, repeat in zip(choices, sorted(again["choices"], key=itemgetter("index"))):
            assert repeat["logprobs"] == whole["logprobs"]

        # The scoring-only form (`max_tokens: 0`): the same prompt logprobs, nothing generated.
        zero = requests.post(server.base + "/v1/completions", json={**payload, "max_tokens": 0}, timeout=300).json()
        assert zero["usage"]["completion_tokens"] == 0
        for whole, only in zip(choices, sorted(zero["choices"], key=itemgetter("index"))):
            assert only["logprobs"]["token_logprobs"] == whole["logprobs"]["token_logprobs"][:-1]
    finally:
        assert server.stop() == 0


def test_lm_eval_string_prompts_score_like_their_token_ids(demo):
    """lm-eval with `tokenized_requests=False` sends the texts; they are scored exactly as the
    token ids the server's tokenizer gives them (with BOS, as /tokenize reports)."""
    texts = ["The cat sat", "on the mat."]
    payload = {"model": "demo", "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    by_text = requests.post(demo.base + "/v1/completions", json={**payload, "prompt": texts}, timeout=60).json()
    ids = [requests.post(demo.base + "/tokenize", json={"prompt": t}, timeout=30).json()["tokens"] for t in texts]
    by_ids = requests.post(demo.base + "/v1/completions", json={**payload, "prompt": ids}, timeout=60).json()
    for a, b, prompt in zip(by_text["choices"], by_ids["choices"], ids):
        assert len(a["logprobs"]["token_logprobs"]) == len(prompt) + 1
        assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]
        assert a["logprobs"]["top_logprobs"] == b["logprobs"]["top_logprobs"]
        assert a["text"].startswith(texts[a["index"]])
    assert parse_logprobs(by_text, [1, 1])
