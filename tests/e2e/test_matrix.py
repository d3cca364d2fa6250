"""The deployment matrix on the CPU reference, through the real binary: every kind of weights
(bf16, a block-FP8 checkpoint, bf16 quantized on load with `--quantization fp8`) under every
multi-rank layout (`--tp N`, `--dp N`, `--tp N --enable-dp-attention`, DP attention over two
processes as two nodes) at 2 and 4 ranks, each driven with the same mixed traffic.

The traffic is what kills engines whose pieces were only tested alone: long prompts arriving
together on every rank (each over half the step's token budget, so that under DP attention the
gathered FFN step holds more rows than one rank's budget), decoding requests joined by new
prompts, prefix-cache hits, `n > 1`, structured output, clients that abort streams, and a KV
cache small enough that the burst preempts. The budgets are tiny (32 tokens, 16-token blocks) so
that every limit is crossed within a few requests.

Every request must succeed, and every greedy output must equal what one rank computes for the
same weights (up to near-ties: where they differ, the one-rank run's top-2 margin there must be
below NEAR_TIE, as float sums in another order can flip only those); the HF oracle prompts must
also match HF transformers where the weights have an oracle.
"""

import json
import random
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server import ROOT, Server, free_addr, start_node
from test_hf_fixtures import comparable

FIXTURES = ROOT / "tests" / "fixtures"
DEMO = ROOT / "assets" / "demo"
NEAR_TIE = 1e-3
REGEX = "[a-z]{2,6}( [a-z]{2,6}){2}"
BUDGET = 32
COMMON = [
    "--device", "cpu", "--served-model-name", "m", "--block-size", "16", "--max-num-batched-tokens", str(BUDGET),
    "--max-num-seqs", "8", "--kv-cache-tokens", "192", "--max-model-len", "128",
]

# (fixture, extra flags, whether HF's oracle applies to these weights)
WEIGHTS = {
    "bf16": ("v3", [], True),
    "fp8-checkpoint": ("v3_fp8", [], True),
    "quantized-on-load": ("v3", ["--quantization", "fp8"], False),
}
LAYOUTS = {
    "tp": lambda n: ["--tp", str(n)],
    "dp": lambda n: ["--dp", str(n)],
    "dp-attention": lambda n: ["--tp", str(n), "--enable-dp-attention"],
    "two-nodes": lambda n: ["--tp", str(n), "--enable-dp-attention"],
}


def model_dir(variant, path):
    path.mkdir(parents=True, exist_ok=True)
    src = FIXTURES / variant
    for name in ("config.json", "model.safetensors"):
        (path / name).symlink_to(src / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, path / name)
    return json.loads((src / "oracle.json").read_text())


def prompts(seed, count, lo, hi):
    rng = random.Random(seed)
    return [[0] + [rng.randrange(2, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def ids_and_gaps(choice):
    """The token ids of a choice, the top-2 margin at each, and its text."""
    ids = [int(t.split(":")[1]) for t in choice.logprobs.tokens]
    gaps = []
    for top in choice.logprobs.top_logprobs:
        best = sorted(top.values(), reverse=True)
        gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return ids, gaps, choice.text


def greedy(client, prompt, max_tokens, n=1, **extra):
    r = client.completions.create(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2, n=n,
        extra_body={"return_tokens_as_token_ids": True, **extra},
    )
    return [ids_and_gaps(c) for c in r.choices]


def abort_stream(client, prompt):
    stream = client.completions.create(model="m", prompt=prompt, max_tokens=60, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    return "aborted"


def traffic(server, ranks, oracle):
    """Runs the mixed traffic; returns {case: [(ids, gaps) per choice]}."""
    client = server.client()
    out = {}
    with ThreadPoolExecutor(16) as pool:
        # Decoding requests first, then a burst of long prompts (4 per rank) while they decode,
        # with streams that are abandoned mid-way and structured output alongside.
        decoding = prompts(1, 2 * ranks, 10, 20)
        burst = prompts(2, 4 * ranks, BUDGET // 2 + 4, 90)
        # Long enough that the burst always arrives while they decode (a tiny model decodes
        # 40 tokens in a fraction of a second), and that two of them outgrow a rank's cache.
        futures = {f"decode{i}": pool.submit(greedy, client, p, 100, ignore_eos=True) for i, p in enumerate(decoding)}
        time.sleep(0.1)
        futures |= {f"burst{i}": pool.submit(greedy, client, p, 12, ignore_eos=True) for i, p in enumerate(burst)}
        aborts = [pool.submit(abort_stream, client, p) for p in prompts(3, 2 * ranks, 20, 40)]
        futures["n2"] = pool.submit(greedy, client, prompts(4, 1, 30, 31)[0], 10, n=2, ignore_eos=True)
        futures["regex"] = pool.submit(greedy, client, prompts(5, 1, 24, 25)[0], 24, guided_regex=REGEX)
        futures |= {
            f"oracle-{p['name']}": pool.submit(greedy, client, p["prompt"], len(p["continuation"]), ignore_eos=True)
            for p in oracle["prompts"]
        }
        for f in aborts:
            assert f.result() == "aborted"
        out = {k: f.result() for k, f in futures.items()}
    # A prompt, then the same prompt with more after it: the second finds the first's blocks.
    base = prompts(6, 1, 60, 61)[0]
    before = server.metrics().get("mla:prefix_cache_hits_total", 0.0)
    out["prefix-first"] = greedy(client, base, 6, ignore_eos=True)
    out["prefix-second"] = greedy(client, base + [7, 8, 9, 10, 11], 6, ignore_eos=True)
    out["prefix-hits"] = server.metrics()["mla:prefix_cache_hits_total"] - before
    return out


def same_greedy(ref, got, what):
    (ref_ids, ref_gaps, _), (ids, _, _) = ref, got
    assert len(ids) == len(ref_ids), f"{what}: {len(ids)} tokens, one rank gave {len(ref_ids)}"
    for i, (a, b) in enumerate(zip(ref_ids, ids)):
        if a != b:
            assert ref_gaps[i] < NEAR_TIE, f"{what}: token {i} is {b}, one rank gave {a} (margin {ref_gaps[i]:.2e})"
            return


def check_alone(out, oracle, hf):
    """What holds for any run: HF's continuation, the regex, n = 2 greedy alike, the cache hit."""
    if hf:
        for p in oracle["prompts"]:
            ids = out[f"oracle-{p['name']}"][0][0]
            k = comparable(p)
            assert ids[:k] == p["continuation"][:k], f"HF oracle {p['name']}"
    first, second = out["n2"]
    same_greedy(first, second, "n = 2: both greedy completions")
    assert out["prefix-hits"] >= 48, f"the longer prompt found {out['prefix-hits']} cached tokens"
    text = out["regex"][0][2]
    assert re.fullmatch(REGEX, text), f"structured output {text!r} does not match {REGEX}"


def start(weights, layout, ranks, tmp_path, steps=()):
    variant, extra, _ = WEIGHTS[weights]
    d = tmp_path / "model"
    oracle = model_dir(variant, d)
    flags = ["--model", str(d), *COMMON, *extra, *steps]
    if layout is None:
        return Server(*flags), None, oracle
    layout_flags = LAYOUTS[layout](ranks)
    if layout != "two-nodes":
        return Server(*flags, *layout_flags), None, oracle
    addr = free_addr()
    node1, log1 = start_node(1, addr, [*flags, *layout_flags])
    server = Server(*flags, *layout_flags, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr)
    return server, (node1, log1), oracle


_REFERENCE = {}
_LOCK = threading.Lock()


def reference(weights, tmp_path_factory):
    """One rank's outputs for these weights (computed once)."""
    with _LOCK:
        if weights not in _REFERENCE:
            server, _, oracle = start(weights, None, 1, tmp_path_factory.mktemp(f"one-rank-{weights}"))
            try:
                out = traffic(server, 1, oracle)
                assert server.metrics()["mla:num_preemptions_total"] > 0, "the burst never preempted"
                check_alone(out, oracle, WEIGHTS[weights][2])
            finally:
                assert server.stop() == 0
            _REFERENCE[weights] = out
        return _REFERENCE[weights]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_layout_under_mixed_traffic_matches_one_rank(weights, layout, ranks, tmp_path, tmp_path_factory):
    metrics = run_against_one_rank(weights, layout, ranks, tmp_path, tmp_path_factory)
    assert metrics["mla:mixed_steps_total"] > 0, "no step mixed prompt chunks and decode rows"


@pytest.mark.parametrize("layout", [None, *LAYOUTS])
@pytest.mark.parametrize("weights", ["bf16", "fp8-checkpoint"])
def test_steps_taking_turns_under_mixed_traffic_match_one_rank(weights, layout, tmp_path, tmp_path_factory):
    """Prefill and decode steps taking turns (`--disable-mixed-chunk`): the same greedy outputs
    as one rank with mixed steps, through the same burst, preemption, aborts, n = 2, structured
    output and prefix hits; and no step mixed."""
    metrics = run_against_one_rank(weights, layout, 2, tmp_path, tmp_path_factory, ["--disable-mixed-chunk"])
    assert metrics["mla:mixed_steps_total"] == 0


@pytest.mark.parametrize("layout", [None, "tp", "dp-attention"])
def test_a_prompt_chunk_cap_under_mixed_traffic_matches_one_rank(layout, tmp_path, tmp_path_factory):
    """`--long-prefill-token-threshold 8` (a quarter of the 32-token budget): every prompt is
    fed in chunks of at most 8 tokens, beside the others, through the same burst, preemption,
    aborts, n = 2 (whose completions fork the block their prompt ends in), structured output
    and prefix hits; the greedy outputs are one uncapped rank's."""
    cap = ["--long-prefill-token-threshold", "8"]
    run_against_one_rank("bf16", layout, 2, tmp_path, tmp_path_factory, cap, log_holds="long_prefill_token_threshold=8")


def run_against_one_rank(weights, layout, ranks, tmp_path, tmp_path_factory, steps=(), log_holds=None):
    ref = reference(weights, tmp_path_factory)
    server, node1, oracle = start(weights, layout, ranks, tmp_path, steps)
    try:
        out = traffic(server, ranks, oracle)
        metrics = server.metrics()
        assert metrics["mla:num_preemptions_total"] > 0, "the burst never preempted"
        # Every request either succeeded (the helpers raise on any error status) or was aborted
        # by its client; none is left running.
        deadline = time.time() + 10
        while server.metrics()["mla:num_requests_running"] > 0:
            assert time.time() < deadline, "requests still running after the traffic ended"
            time.sleep(0.1)
        _, _, hf = WEIGHTS[weights]
        check_alone(out, oracle, hf)
        for case, choices in ref.items():
            if case == "prefix-hits":
                continue
            for i, (r, g) in enumerate(zip(choices, out[case])):
                same_greedy(r, g, f"{weights} {layout} x{ranks} {case}[{i}]")
        assert "internal error" not in server.log_text()
        if log_holds is not None:
            assert log_holds in server.log_text(), f"the log does not say {log_holds!r}"
    finally:
        code = server.stop()
        if node1 is not None:
            node1[0].wait(timeout=30)
        assert code == 0, server.log_text()[-4000:]
    return metrics
