"""`--kv-cache-dtype fp8` through the real binary on the CPU reference backend, which stores and
reads the same FP8 rows as the CUDA backend (mla_core::model::latent_fp8): the startup log and
/metrics say what the cache holds; on the `real_dims` fixture (the published 576-value latent
rows, nine scale groups) concurrent greedy requests, each prompt twice (the second finds its
prefix cached), give the same tokens in every layout (one rank, --tp 2, --dp 2, DP attention,
DP attention over two nodes) and with a cache so small that requests are preempted and
recomputed; nodes that disagree on the cache dtype are refused. Their distance from HF itself
is the Rust test `mla-cpu/tests/fp8_cache_accuracy.rs`."""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from server import Server, free_addr, run_cli, start_node
from test_parallel import greedy_completion, model_dir, token_ids

VARIANT = "real_dims"
LAYOUTS = {
    "one-rank": [],
    "tensor-parallel": ["--tp", "2"],
    "replicas": ["--dp", "2"],
    "dp-attention": ["--tp", "2", "--enable-dp-attention"],
    "preempted": ["--kv-cache-tokens", "192"],
}


def run_layout(flags, tmp_path, node1_flags=None):
    oracle = model_dir(VARIANT, tmp_path)
    node1 = None
    if node1_flags is not None:
        node1, node1_log = start_node(1, node1_flags[0], node1_flags[1])
    server = Server(
        "--model",
        str(tmp_path),
        "--device",
        "cpu",
        "--served-model-name",
        VARIANT,
        "--kv-cache-dtype",
        "fp8",
        "--block-size",
        "16",
        *flags,
    )
    try:
        log = server.log_text()
        client = server.client()
        prompts = oracle["prompts"] * 2

        def greedy(p):
            r = greedy_completion(client, VARIANT, p)
            return token_ids(r), r.usage

        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(greedy, prompts))
        # The same prompts again, one at a time: their prefixes are cached now.
        again = [greedy(p) for p in oracle["prompts"]]
        metrics = server.metrics()
        return log, metrics, [o for o, _ in outputs], again
    finally:
        assert server.stop() == 0
        if node1 is not None:
            assert node1.wait(timeout=30) == 0, open(node1_log).read()


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_layout([], tmp_path_factory.mktemp("fp8-one-rank"))


def test_the_log_and_metrics_say_the_cache_is_fp8(one_rank):
    log, metrics, _, _ = one_rank
    # real_dims: 2 layers x 592-byte rows.
    assert re.search(r"KV cache: \d+ tokens per attention rank \([^)]*1184 bytes per token in fp8_e4m3\)", log), log
    info = [k for k in metrics if k.startswith("vllm:cache_config_info") or "cache_config_info" in k]
    assert any('cache_dtype="fp8"' in k for k in info), info


def test_prefix_cache_hits_give_the_same_tokens(one_rank):
    _, _, outputs, again = one_rank
    n = len(again)
    for (tokens, usage), first in zip(again, outputs[:n]):
        assert tokens == first
        # Whole blocks of 16 are cached: every prompt but the 5-token one has one.
        if usage.prompt_tokens > 16:
            assert usage.prompt_tokens_details.cached_tokens > 0, usage


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "one-rank"])
def test_every_layout_gives_the_one_rank_tokens(layout, one_rank, tmp_path):
    _, _, want, _ = one_rank
    log, metrics, got, _ = run_layout(LAYOUTS[layout], tmp_path)
    assert got == want, layout
    if layout == "preempted":
        assert metrics["mla:num_preemptions_total"] > 0, "no request was preempted"


def test_two_nodes_give_the_one_rank_tokens(one_rank, tmp_path):
    _, _, want, _ = one_rank
    addr = free_addr()
    layout = ["--tp", "2", "--enable-dp-attention"]
    common = ["--model", str(tmp_path), "--device", "cpu", "--kv-cache-dtype", "fp8", "--block-size", "16", *layout]
    log, _, got, _ = run_layout(
        [*layout, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr], tmp_path, (addr, common)
    )
    assert "on 2 nodes" in log
    assert got == want


def test_nodes_that_disagree_on_the_cache_dtype_are_refused(tmp_path):
    model_dir(VARIANT, tmp_path)
    addr = free_addr()
    base = ["--model", str(tmp_path), "--device", "cpu", "--tp", "2", "--dist-timeout", "20"]
    node1, log1 = start_node(1, addr, base + ["--kv-cache-dtype", "fp8"])
    r = run_cli(*base, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr, "--port", "0")
    assert r.returncode != 0 and "fp8_e4m3" in r.stderr, r.stderr
    assert node1.wait(timeout=30) != 0
