"""Automatic prefix caching through the real server: greedy outputs with cache hits equal HF's
and a caching-off server's, `usage.prompt_tokens_details.cached_tokens` says what was reused,
and /metrics counts queries and hits.

On the CPU the fixtures run with 4-token blocks so their short prompts span several blocks. With
MLA_E2E_DEVICE=cuda (a GPU machine) the real_dims fixture runs in bf16 with the CUDA block size
of 64, where only the longer, constructed prompts (second chat turns) reach a full block.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from server import Server
from test_hf_fixtures import comparable
from test_parallel import model_dir

DEVICE = os.environ.get("MLA_E2E_DEVICE", "cpu")
if DEVICE == "cuda":
    # Two servers share the GPU: a fixed cache size, as the utilization counts the other's memory.
    VARIANT, BLOCK, FLAGS = "real_dims", 64, ["--device", "cuda", "--kv-cache-tokens", "65536"]
else:
    VARIANT, BLOCK, FLAGS = "v2_lite", 4, ["--device", "cpu", "--block-size", "4"]


def greedy(client, prompt, max_tokens):
    r = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
    return ids, r.usage.prompt_tokens_details.cached_tokens


def expected_hit(prompt_len, cached_len):
    """Full blocks before the block of the last prompt token, as far as the cache has them."""
    return min((prompt_len - 1) // BLOCK, cached_len // BLOCK) * BLOCK


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model")
    oracle = model_dir(VARIANT, tmp)
    on = Server("--model", str(tmp), "--served-model-name", "m", *FLAGS)
    off = Server("--model", str(tmp), "--served-model-name", "m", *FLAGS, "--no-enable-prefix-caching")
    yield oracle, on, off
    assert on.stop() == 0 and off.stop() == 0


def test_repeated_prompts_hit_the_cache_and_still_match_hf(servers):
    oracle, on, _ = servers
    client = on.client()
    for p in oracle["prompts"]:
        n = len(p["continuation"])
        for attempt in range(2):
            got, cached = greedy(client, p["prompt"], n)
            k = comparable(p)
            assert got[:k] == p["continuation"][:k], f"{p['name']}, attempt {attempt}"
            # The first run also computes the output's blocks; the second finds the prompt's.
            want = 0 if attempt == 0 else expected_hit(len(p["prompt"]), len(p["prompt"]))
            assert cached == want, f"{p['name']}, attempt {attempt}: cached {cached}, expected {want}"
    m = on.metrics()
    # With 64-token blocks (cuda) the fixture prompts are too short to reuse a block.
    if any(expected_hit(len(p["prompt"]), len(p["prompt"])) for p in oracle["prompts"]):
        assert m["mla:prefix_cache_hits_total"] > 0
    assert m["mla:prefix_cache_queries_total"] >= m["mla:prefix_cache_hits_total"] > -1


def test_shared_prefixes_second_turns_and_concurrency_equal_caching_off(servers):
    """Prompts that share 1, 2 and more blocks with earlier ones, a prompt that is exactly a
    cached prefix, the same prompt twice, a second chat turn extending the first turn's prompt
    and reply: in sequence, then all at once, each equal to the caching-off server's output."""
    oracle, on, off = servers
    base = oracle["prompts"][-1]["prompt"]
    first_turn, _ = greedy(off.client(), base, 24)
    vocab_top = max(base) + 1
    tail = [(t * 7 + 3) % vocab_top for t in range(40)]
    prompts = [
        base[:BLOCK] + tail[:9],  # shares one block
        base[: 2 * BLOCK] + tail[:5],  # shares two
        base[: len(base) // BLOCK * BLOCK],  # exactly a cached prefix
        base,  # the same prompt again
        base + first_turn + tail[:11],  # the second turn of a chat
        base + first_turn + tail[:11] + tail[20:37],  # and the third
    ]
    if DEVICE == "cuda":
        # One 64-token block is longer than the fixture prompts, and real_dims allows 128
        # positions: prompts of 65-112 tokens, which can reuse their first block.
        long_base = (base + first_turn + tail)[:96]
        prompts = [long_base, long_base + tail[:13], long_base[:BLOCK] + tail[:20], long_base[:BLOCK] + tail[5:6]]
    want = [greedy(off.client(), p, 16)[0] for p in prompts]
    client = on.client()
    greedy(client, base, 24)
    seq = [greedy(client, p, 16) for p in prompts]
    for i, ((got, cached), w) in enumerate(zip(seq, want)):
        assert got == w, f"prompt {i} in sequence"
    assert any(c > 0 for _, c in seq), [c for _, c in seq]
    with ThreadPoolExecutor(len(prompts) * 2) as pool:
        together = list(pool.map(lambda p: greedy(client, p, 16)[0], prompts * 2))
    for i, (got, w) in enumerate(zip(together, want * 2)):
        assert got == w, f"prompt {i % len(prompts)} sent concurrently"


def deepseek_fields_agree(usage):
    """DeepSeek's platform's split of the prompt, beside OpenAI's cached_tokens."""
    cached = usage.prompt_tokens_details.cached_tokens
    assert (usage.prompt_cache_hit_tokens, usage.prompt_cache_miss_tokens) == (cached, usage.prompt_tokens - cached)


def test_chat_usage_reports_cached_tokens(servers):
    _, on, off = servers
    messages = [{"role": "system", "content": "You are terse. " * 12}, {"role": "user", "content": "Hello there"}]
    client = on.client()
    client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == expected_hit(r.usage.prompt_tokens, r.usage.prompt_tokens)
    assert r.usage.prompt_tokens_details.cached_tokens > 0 or r.usage.prompt_tokens <= BLOCK
    deepseek_fields_agree(r.usage)
    # Streamed, the usage chunk carries them too.
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens_details.cached_tokens
    deepseek_fields_agree(usage)
    r = off.client().chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    deepseek_fields_agree(r.usage)
    assert off.metrics().get("mla:prefix_cache_queries_total", 0) == 0
