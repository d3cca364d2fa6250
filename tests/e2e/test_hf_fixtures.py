"""Greedy output through the whole server equals HF transformers' continuation.

Each fixture model (tests/fixtures/<variant>: config + safetensors + HF oracle) is served with the
demo tokenizer copied next to it (both have 512 ids). The prompts go in as token ids, all three in
one request so they are batched; the generated ids come back through `return_tokens_as_token_ids`
and must equal HF's greedy continuation up to the first near-tie (top-2 logit gap < 1e-3).

With MLA_E2E_DEVICE=cuda (run on a GPU machine) the server runs `--device cuda` on the fixtures
whose MLA dims the kernels are built for (real_dims in bf16; v3_fp8_real_dims with its block-FP8
weights kept in FP8, prompts prefilled in W8A8), and a near-tie is a gap below 0.05:
HF's own bf16 run moves logits by up to ~0.02 around its f32 values on these models (measured on
the H200, docs/cuda-backend.md), so a smaller gap may flip in bf16 without any bug.
"""

import contextlib
import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from server import ROOT, Server, free_addr, start_node

FIXTURES = ROOT / "tests" / "fixtures"
DEMO = ROOT / "assets" / "demo"
DEVICE = os.environ.get("MLA_E2E_DEVICE", "cpu")
# More server flags, e.g. "--tp 2 --enable-dp-attention" (scripts/gpu_multi_run.sh).
EXTRA_FLAGS = os.environ.get("MLA_E2E_FLAGS", "").split()
# With N > 1 the layout is split over N processes on this host (`--nnodes N`), one GPU each on
# cuda (node i sees GPU i only): the multi-node path without a second machine.
NODES = int(os.environ.get("MLA_E2E_NODES", "1"))
if DEVICE == "cuda":
    VARIANTS = ["real_dims", "v3_fp8_real_dims"]
    NEAR_TIE = 0.05
    DEVICE_FLAGS = ["--device", "cuda", "--gpu-memory-utilization", "0.3"]
else:
    VARIANTS = ["v2_lite", "v2", "v3", "v3_fp8", "real_dims", "v3_fp8_real_dims"]
    NEAR_TIE = 1e-3
    DEVICE_FLAGS = ["--device", "cpu"]


def comparable(prompt):
    gaps = prompt["gaps"]
    return next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))


@contextlib.contextmanager
def served(variant, tmp_path):
    """The fixture model behind the real server (on NODES processes), with its HF oracle."""
    src = FIXTURES / variant
    # The fixtures are committed (tests/fixtures/README.md): without its oracle a test proves nothing.
    assert (src / "oracle.json").exists(), f"fixture {variant} is missing from {src}"
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(src / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, tmp_path / name)
    oracle = json.loads((src / "oracle.json").read_text())
    flags = ["--model", str(tmp_path), *DEVICE_FLAGS, *EXTRA_FLAGS]
    followers, node0 = [], []
    if NODES > 1:
        addr = free_addr()
        followers = [start_node(i, addr, flags, nnodes=NODES, env=node_env(i)) for i in range(1, NODES)]
        node0 = ["--nnodes", str(NODES), "--node-rank", "0", "--dist-init-addr", addr]
    try:
        server = Server(*flags, "--served-model-name", variant, *node0, env=node_env(0))
    except Exception:
        for proc, _ in followers:
            proc.kill()
        raise
    try:
        # stderr is a file here, not a terminal: loading logs its progress as lines.
        assert "100% (" in server.log_text(), server.log_text()
        yield server, oracle
    finally:
        assert server.stop() == 0
        for proc, log in followers:
            assert proc.wait(timeout=60) == 0, Path(log).read_text()


def check_choice(variant, p, choice):
    got = [int(t.split(":")[1]) for t in choice.logprobs.tokens]
    k = comparable(p)
    assert got[:k] == p["continuation"][:k], f"{variant}/{p['name']}"
    text_check(choice.text, p["continuation"][:k], got)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_continuation_matches_hf(variant, tmp_path):
    with served(variant, tmp_path) as (server, oracle):
        client = server.client()
        prompts = oracle["prompts"]
        r = client.completions.create(
            model=variant,
            prompt=[p["prompt"] for p in prompts],
            max_tokens=max(len(p["continuation"]) for p in prompts),
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        for p, choice in zip(prompts, sorted(r.choices, key=lambda c: c.index)):
            check_choice(variant, p, choice)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompts_arriving_while_others_decode_match_hf(variant, tmp_path):
    """Each prompt is its own request, sent once the previous one is decoding, so its prefill
    shares steps with their decode rows (mixed steps, unless --disable-mixed-chunk): the
    outputs still equal HF's."""
    with served(variant, tmp_path) as (server, oracle):
        client = server.client()
        prompts = oracle["prompts"]
        # 32 tokens past the oracle's continuation (within the model's length), so each is still
        # decoding when the next prompt arrives; only the continuation is compared.
        limit = json.loads((FIXTURES / variant / "config.json").read_text())["max_position_embeddings"]

        def max_tokens(p):
            return min(limit - len(p["prompt"]), len(p["continuation"]) + 32)

        def run(p, started):
            stream = client.completions.create(
                model=variant, prompt=p["prompt"], max_tokens=max_tokens(p), temperature=0, logprobs=0,
                stream=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )
            tokens = []
            for chunk in stream:
                c = chunk.choices[0]
                tokens.extend(c.logprobs.tokens if c.logprobs else [])
                # Past its prefill: two tokens out (a first chunk may come before the prefill).
                if len(tokens) >= 2:
                    started.set()
            started.set()
            return tokens

        def staggered():
            with ThreadPoolExecutor(len(prompts)) as pool:
                futures = []
                for p in prompts:
                    started = threading.Event()
                    futures.append(pool.submit(run, p, started))
                    started.wait(timeout=60)
                outs = [f.result() for f in futures]
            for p, tokens in zip(prompts, outs):
                got = [int(t.split(":")[1]) for t in tokens]
                k = comparable(p)
                assert got[:k] == p["continuation"][:k], f"{variant}/{p['name']}"

        # One scheduler sees every request: a prompt meets the others' decode rows in its steps.
        # (With several attention ranks each may hold one request, and nothing mixes.) On a
        # loaded machine a request may end before the next arrives, so the round is run again,
        # outputs checked each time, until a step has mixed (three rounds at most).
        one_scheduler = not {"--dp", "--enable-dp-attention"} & set(EXTRA_FLAGS)
        must_mix = "--disable-mixed-chunk" not in EXTRA_FLAGS and one_scheduler
        for _ in range(3):
            staggered()
            if not must_mix or server.metrics()["mla:mixed_steps_total"] > 0:
                break
        if must_mix:
            assert server.metrics()["mla:mixed_steps_total"] > 0, "no step was mixed in three rounds"


def node_env(node_rank):
    return {"CUDA_VISIBLE_DEVICES": str(node_rank)} if NODES > 1 and DEVICE == "cuda" else None


def text_check(text, want_ids, got_ids):
    """The returned text is the demo tokenizer's decode of the ids (by HF's Python tokenizers,
    when installed); only checked when the whole output is in the comparable range."""
    try:
        import tokenizers
    except ImportError:
        return
    if len(got_ids) != len(want_ids):
        return
    tok = tokenizers.Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    assert text == tok.decode(want_ids, skip_special_tokens=True)
