"""vLLM's startup flags and metrics as vLLM's own tests and dashboards read them:
`--enforce-eager`, `--enable-chunked-prefill`, `--max-logprobs`, `--enable-force-include-usage`,
`--enable-prompt-tokens-details`, and `--metrics-prefix vllm`
with every series docs/metrics.md promises (vLLM's counting of iteration_tokens_total)."""

import pytest
import requests

from server import Server, run_cli
from test_metrics import parse, value


@pytest.fixture(scope="module")
def vllm_like():
    server = Server(
        "--max-model-len", "512", "--enforce-eager", "--enable-chunked-prefill", "--max-logprobs", "3",
        "--metrics-prefix", "vllm", "--max-num-seqs", "16", "--enable-force-include-usage",
        "--enable-prompt-tokens-details", "--return-tokens-as-token-ids",
    )
    yield server
    server.stop()


def test_max_logprobs_is_the_limit(vllm_like):
    c = vllm_like.client()
    r = c.completions.create(model="demo", prompt="x", max_tokens=2, logprobs=3)
    # --return-tokens-as-token-ids is the default of the field, which a request may still turn off.
    assert len(r.choices[0].logprobs.tokens) == 2 and r.choices[0].logprobs.tokens[0].startswith("token_id:")
    r = c.completions.create(
        model="demo", prompt="x", max_tokens=2, logprobs=3, extra_body={"return_tokens_as_token_ids": False}
    )
    assert not r.choices[0].logprobs.tokens[0].startswith("token_id:")
    for body in ({"logprobs": 4}, {"prompt_logprobs": 4}):
        r = requests.post(vllm_like.base + "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2, **body})
        assert r.status_code == 400 and "3" in r.json()["error"]["message"], r.text
    r = requests.post(vllm_like.base + "/v1/chat/completions", json={
        "model": "demo", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 4,
    })
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_force_include_usage_puts_the_usage_on_every_chunk(vllm_like):
    chunks = list(vllm_like.client().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=5, stream=True,
        extra_body={"ignore_eos": True},
    ))
    assert all(c.usage is not None for c in chunks), "no stream_options, yet every chunk has it"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens_details.cached_tokens == 0


def test_metrics_under_vllms_prefix_count_as_vllm_does(vllm_like):
    prompt, requests_sent, max_tokens = [0, 5, 6, 7, 8, 9, 10], 3, 10
    before = parse(requests.get(vllm_like.base + "/metrics", timeout=10).text)
    for _ in range(requests_sent):
        vllm_like.client().completions.create(
            model="demo", prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
    text = requests.get(vllm_like.base + "/metrics", timeout=10).text
    families = parse(text)
    assert not [n for n in families if not n.startswith("vllm:")], "one prefix for every series"
    # vLLM's per-step count: prompt tokens computed plus tokens sampled, one step per token.
    added = {
        s: value(families, f"vllm:iteration_tokens_total_{s}") - value(before, f"vllm:iteration_tokens_total_{s}")
        for s in ("sum", "count")
    }
    assert added == {"sum": requests_sent * (len(prompt) + max_tokens), "count": requests_sent * max_tokens}
    waiting = {l["reason"]: v for n, l, v in families["vllm:num_requests_waiting_by_reason"]["samples"]}
    assert waiting == {"capacity": 0.0, "deferred": 0.0}
    [(_, info, one)] = families["vllm:cache_config_info"]["samples"]
    assert one == 1.0 and info["block_size"] == "64" and info["enable_prefix_caching"] == "True"
    assert int(info["num_gpu_blocks"]) * 64 == value(families, "vllm:kv_cache_capacity_tokens")
    assert int(info["kv_cache_size_tokens"]) == value(families, "vllm:kv_cache_capacity_tokens")
    assert float(info["kv_cache_max_concurrency"]) == int(info["kv_cache_size_tokens"]) / 512


def test_chunked_prefill_cannot_be_turned_off():
    r = run_cli("--no-enable-chunked-prefill", "--port", "1")
    assert r.returncode != 0 and "chunked prefill" in r.stderr, r.stderr


def test_vllm_api_key_variable_guards_the_api():
    server = Server("--max-model-len", "256", env={"VLLM_API_KEY": "abc-123"})
    try:
        body = {"model": "demo", "prompt": "x", "max_tokens": 1}
        assert requests.post(server.base + "/v1/completions", json=body, timeout=30).status_code == 401
        auth = {"Authorization": "Bearer abc-123"}
        assert requests.post(server.base + "/v1/completions", json=body, headers=auth, timeout=30).status_code == 200
    finally:
        server.stop()
