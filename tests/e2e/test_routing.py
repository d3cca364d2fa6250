"""Prefix-aware routing across attention ranks through the real binary on the CPU (the v2_lite
fixture, 4-token blocks), under `--dp 2` and DP attention at 2 and 4 ranks.

The issue's scenario: conversations start together (so they land on different ranks), then each
sends its second turn alone. Routed by load alone, every lone turn goes to rank 0 and only the
conversations that started there find their history; routed by prefix, every one does. A hot
prefix held by one rank then gets a burst of requests: the balance rule sends part of it to the
other ranks. Greedy outputs are the same whichever policy routed them, and every response
carries DeepSeek's `prompt_cache_hit_tokens` / `prompt_cache_miss_tokens`.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server import Server, run_cli
from test_parallel import model_dir

BLOCK = 4
LAYOUTS = {
    "dp2": (["--dp", "2"], 2),
    "dpa2": (["--tp", "2", "--enable-dp-attention"], 2),
    "dpa4": (["--tp", "4", "--enable-dp-attention"], 4),
}
COMMON = ["--device", "cpu", "--served-model-name", "m", "--block-size", str(BLOCK), "--max-model-len", "128"]
# Small enough that the hot-prefix burst crosses it within two requests (each may hold 68).
BALANCE = ["--router-balance-abs-threshold", "100"]
SECOND_TURNS = 20
FIRST_LEN, REPLY, NEW = 24, 8, 6


def first_prompt(conversation: int) -> list:
    return [(conversation * 37 + i * 11) % 500 + 2 for i in range(FIRST_LEN)]


def send(client, prompt, max_tokens):
    r = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    u = r.usage
    cached = u.prompt_tokens_details.cached_tokens
    # DeepSeek's fields, beside OpenAI's: the prompt split into cache hits and misses.
    assert (u.prompt_cache_hit_tokens, u.prompt_cache_miss_tokens) == (cached, u.prompt_tokens - cached), u
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens], cached


def conversations(server, ranks):
    """SECOND_TURNS conversations, `ranks` at a time: their first turns together, then each
    second turn alone. Returns every turn's output and each second turn's cached tokens."""
    client = server.client()
    outputs, cached = {}, []
    for start in range(0, SECOND_TURNS, ranks):
        group = list(range(start, start + ranks))
        with ThreadPoolExecutor(ranks) as pool:
            replies = list(pool.map(lambda c: send(client, first_prompt(c), REPLY)[0], group))
        for c, reply in zip(group, replies):
            outputs[(c, 1)] = reply
            second = first_prompt(c) + reply + [(c * 7 + i) % 500 + 2 for i in range(NEW)]
            outputs[(c, 2)], hit = send(client, second, 4)
            cached.append(hit)
    return outputs, cached


def rank_series(server, name, ranks):
    m = server.metrics()
    return [m.get(f'mla:{name}{{model_name="m",rank="{r}"}}', 0.0) for r in range(ranks)]


def decisions(server):
    m = server.metrics()
    return {r: m[f'mla:router_decisions_total{{model_name="m",reason="{r}"}}'] for r in ("prefix", "balance", "tie")}


# The first turn computes its 24 prompt tokens and 7 of its 8 outputs: 7 full blocks.
HISTORY = (FIRST_LEN + REPLY - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model")
    model_dir("v2_lite", tmp)
    return tmp


def run_conversations(model, flags, ranks, *policy):
    server = Server("--model", str(model), *COMMON, *flags, *policy)
    try:
        return server, conversations(server, ranks)
    except BaseException:
        server.stop()
        raise


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_conversations_find_their_history_on_the_rank_that_holds_it(layout, model):
    flags, ranks = LAYOUTS[layout]
    # The baseline, routed by load alone: every lone second turn goes to rank 0, so only the
    # conversations that started there find their history (the 9-10 of 20 at 2 ranks;
    # more when a first turn ended before its partner arrived and both ran on rank 0).
    baseline, (baseline_outputs, baseline_cached) = run_conversations(model, flags, ranks, "--router-policy",
                                                                      "least-loaded")
    assert baseline.stop() == 0
    assert sum(c == HISTORY for c in baseline_cached) < 18, f"the baseline found them too: {baseline_cached}"
    server, (outputs, cached) = run_conversations(model, flags, ranks, *BALANCE)
    try:
        assert f"routing over {ranks} attention ranks: to the longest cached prefix" in server.log_text()
        found = sum(c == HISTORY for c in cached)
        assert found >= 18, f"{found} of {SECOND_TURNS} second turns found their history: {cached}"
        # The conversations started on every rank, and each rank served its own second turns.
        queries = rank_series(server, "rank_prefix_cache_queries_total", ranks)
        hits = rank_series(server, "rank_prefix_cache_hits_total", ranks)
        assert all(q > 0 for q in queries) and all(h > 0 for h in hits), (queries, hits)
        d = decisions(server)
        assert d["prefix"] >= found and d["tie"] >= SECOND_TURNS, d
        # Routing changes where a request runs and what it recomputes, never what it answers.
        assert outputs == baseline_outputs
        hot_prefix_burst(server, ranks)
    finally:
        assert server.stop() == 0


def hot_prefix_burst(server, ranks):
    """One rank computes a 48-token prefix; then 8 requests per rank that share it arrive at
    once. Routed by prefix alone, all would go to that rank; under the balance rule (100 tokens,
    1.5x) it takes more than its share only by the rule's slack, and every rank gets some."""
    client = server.client()
    hot = [(i * 13) % 500 + 2 for i in range(48)]
    send(client, hot + [3, 4, 5], 1)
    before = rank_series(server, "rank_prefix_cache_queries_total", ranks)
    d0 = decisions(server)
    burst = [hot + [(b * 5 + i) % 500 + 2 for i in range(4)] for b in range(8 * ranks)]
    with ThreadPoolExecutor(len(burst)) as pool:
        list(pool.map(lambda p: send(client, p, 16), burst))
    # Counters are published by the engine thread after each step: wait for the last one.
    deadline = time.time() + 30
    while sum(rank_series(server, "rank_prefix_cache_queries_total", ranks)) - sum(before) < len(burst) * 52:
        assert time.time() < deadline, "the burst was not admitted"
        time.sleep(0.05)
    after = rank_series(server, "rank_prefix_cache_queries_total", ranks)
    per_rank = [round((a - b) / 52) for a, b in zip(after, before)]
    d1 = decisions(server)
    assert d1["balance"] > d0["balance"], (d0, d1)
    assert min(per_rank) >= 1, f"a rank got none of the burst: {per_rank}"
    assert max(per_rank) <= 3 * min(per_rank), f"one rank took most of the burst: {per_rank}"


def test_routing_flags_that_would_change_nothing_are_refused():
    for args, says in [
        (["--router-policy", "prefix"], "this layout has one"),
        (["--dp", "2", "--no-enable-prefix-caching", "--router-policy", "prefix"], "prefix caching is off"),
        (["--dp", "2", "--router-policy", "least-loaded", "--router-balance-rel-threshold", "2"], "no balance rule"),
    ]:
        r = run_cli("--device", "cpu", *args)
        assert r.returncode != 0 and says in r.stderr, (args, r.stderr[-500:])
