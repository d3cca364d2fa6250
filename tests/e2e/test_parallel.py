"""The multi-rank layouts through the real binary on the CPU reference backend, which runs each
rank as a thread with an in-process collective (the correctness reference for the GPU ranks):
`--tp 2 --enable-dp-attention`, `--dp 2` and `--tp 2`. Concurrent greedy requests, one per
prompt and each prompt twice, must reproduce HF transformers' continuation (tests/fixtures), and
/metrics must show the ranks."""

import json
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server import ROOT, Server, free_addr, start_node
from test_hf_fixtures import comparable

FIXTURES = ROOT / "tests" / "fixtures"
DEMO = ROOT / "assets" / "demo"

LAYOUTS = {
    "dp-attention": (["--tp", "2", "--enable-dp-attention"], 2),
    "replicas": (["--dp", "2"], 2),
    "tensor-parallel": (["-tp", "2"], 1),
}


def greedy_completion(client, model, p):
    """An oracle prompt's greedy completion of its continuation's length, as token ids (`token_ids`)."""
    return client.completions.create(
        model=model,
        prompt=p["prompt"],
        max_tokens=len(p["continuation"]),
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )


def token_ids(completion):
    return [int(t.split(":")[1]) for t in completion.choices[0].logprobs.tokens]


def model_dir(variant, tmp_path):
    src = FIXTURES / variant
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(src / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, tmp_path / name)
    return json.loads((src / "oracle.json").read_text())


@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_concurrent_greedy_requests_match_hf(layout, variant, tmp_path):
    flags, attention_ranks = LAYOUTS[layout]
    oracle = model_dir(variant, tmp_path)
    server = Server("--model", str(tmp_path), "--device", "cpu", "--served-model-name", variant, *flags)
    try:
        assert "parallel layout" in server.log_text()
        metrics = server.metrics()
        assert metrics["mla:num_attention_ranks"] == attention_ranks
        client = server.client()
        prompts = oracle["prompts"] * 2

        def greedy(p):
            return token_ids(greedy_completion(client, variant, p))

        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(greedy, prompts))
        for p, got in zip(prompts, outputs):
            k = comparable(p)
            assert got[:k] == p["continuation"][:k], f"{layout} {variant}/{p['name']}"
        metrics = server.metrics()
        ranks = [metrics[f'mla:rank_load_tokens{{model_name="{variant}",rank="{r}"}}'] for r in range(attention_ranks)]
        assert ranks == [0.0] * attention_ranks, "every request's load is taken off its rank"
        assert metrics["mla:generation_tokens_total"] == sum(len(p["continuation"]) for p in prompts)
    finally:
        assert server.stop() == 0


def test_a_rank_that_dies_fails_its_requests_and_stops_the_server(tmp_path):
    """Rank 1 panics at its 4th step (MLA_TEST_KILL_RANK, a test hook): rank 0 is then waiting
    in a collective. The accepted requests are answered with an error naming the rank, /health
    turns 503, and the process exits non-zero within seconds instead of hanging."""
    import time

    import openai
    import requests

    model_dir("v2_lite", tmp_path)
    server = Server(
        "--model", str(tmp_path), "--device", "cpu", "--served-model-name", "m",
        "--tp", "2", "--enable-dp-attention", "--shutdown-timeout", "2",
        env={"MLA_TEST_KILL_RANK": "1:4"},
    )
    try:
        client = server.client()

        def request(i):
            try:
                client.completions.create(model="m", prompt=[1 + i, 2, 3], max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True})
                return "completed"
            except openai.APIStatusError as e:
                return f"{e.status_code} {e.message}"

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(request, range(4)))
        assert all(r.startswith("500") and "rank 1" in r for r in results), results
        deadline = time.time() + 15
        while server.proc.poll() is None and time.time() < deadline:
            try:
                health = requests.get(server.base + "/health", timeout=1)
                if health.status_code == 503:
                    assert "rank 1" in health.json()["error"]["message"]
            except requests.RequestException:
                pass
            time.sleep(0.1)
        assert server.proc.poll() is not None, "the server did not exit within 15 s of the rank's death"
        assert server.proc.returncode != 0
        assert "the engine stopped" in server.log_text() and "killed at step 4" in server.log_text()
    finally:
        server.stop()


def test_a_signal_after_the_engine_died_still_exits_non_zero(tmp_path):
    """An operator's SIGINT that lands after the rank died but before the server noticed (it
    polls every 200 ms) used to take the clean path and exit 0; a dead engine must exit non-zero
    whatever signal comes, and without the segfault of running the device libraries' exit
    handlers under a stuck rank."""
    import signal

    import openai
    import requests

    model_dir("v2_lite", tmp_path)
    server = Server(
        "--model", str(tmp_path), "--device", "cpu", "--served-model-name", "m",
        "--tp", "2", "--enable-dp-attention", "--shutdown-timeout", "30",
        env={"MLA_TEST_KILL_RANK": "1:3"},
    )
    try:
        client = server.client()
        with pytest.raises(openai.APIStatusError):
            client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=40, extra_body={"ignore_eos": True})
        # The first moment the death shows: signal at once. A server that noticed first may be
        # gone already (refusing connections); its exit status is checked all the same.
        deadline = time.time() + 10
        while True:
            try:
                if requests.get(server.base + "/health", timeout=1).status_code == 503:
                    break
            except requests.exceptions.ConnectionError:
                break
            assert time.time() < deadline, "/health never turned 503"
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGINT)
        server.proc.wait(timeout=20)
        assert server.proc.returncode not in (0, -signal.SIGSEGV, 139), server.proc.returncode
        assert "the engine stopped" in server.log_text()
    finally:
        server.stop()


@pytest.mark.parametrize("layout", ["dp-attention", "tensor-parallel"])
def test_two_nodes_serve_hf_greedy_and_stop_together(layout, tmp_path):
    """Two processes, one rank each, meeting at --dist-init-addr (the CPU ranks' collective goes
    through node 0's hub): the same HF-fixture checks as one node; SIGTERM to node 0 stops node 1
    cleanly too."""
    from pathlib import Path

    flags, attention_ranks = LAYOUTS[layout]
    oracle = model_dir("v2_lite", tmp_path)
    addr = free_addr()
    common = ["--model", str(tmp_path), "--device", "cpu", *flags]
    node1, log1 = start_node(1, addr, common)
    server = Server(*common, "--served-model-name", "m", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr)
    try:
        assert "on 2 nodes" in server.log_text()
        assert server.metrics()["mla:num_attention_ranks"] == attention_ranks
        client = server.client()
        prompts = oracle["prompts"] * 2

        def greedy(p):
            return token_ids(greedy_completion(client, "m", p))

        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(greedy, prompts))
        for p, got in zip(prompts, outputs):
            k = comparable(p)
            assert got[:k] == p["continuation"][:k], f"{layout} {p['name']}"
        # A grammar-constrained step reaches node 1 once its masks exist (they are computed
        # while the step runs; sent any earlier, it waited for them and failed after 60 s).
        started = time.monotonic()
        r = client.with_options(timeout=30).completions.create(
            model="m", prompt="x", max_tokens=24, temperature=1.0, seed=1, n=2,
            extra_body={"guided_regex": "(ab|cd){1,5}"},
        )
        assert all(re.fullmatch("(ab|cd){1,5}", c.text) for c in r.choices), [c.text for c in r.choices]
        assert time.monotonic() - started < 20
    finally:
        assert server.stop() == 0
        assert node1.wait(timeout=30) == 0, Path(log1).read_text()


def test_a_node_that_dies_stops_node_0_with_an_error(tmp_path):
    import signal
    import time

    import openai

    model_dir("v2_lite", tmp_path)
    addr = free_addr()
    common = ["--model", str(tmp_path), "--device", "cpu", "--tp", "2", "--enable-dp-attention"]
    node1, _ = start_node(1, addr, common)
    server = Server(*common, "--served-model-name", "m", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr,
                    "--shutdown-timeout", "2")
    try:
        client = server.client()
        client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=4)
        node1.send_signal(signal.SIGKILL)
        node1.wait()
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="m", prompt=[[4, 5, 6], [7, 8, 9]], max_tokens=8)
        assert "node 1" in err.value.message
        deadline = time.time() + 15
        while server.proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert server.proc.returncode not in (None, 0), "node 0 kept running after node 1 died"
        assert "the engine stopped" in server.log_text()
    finally:
        server.stop()


def test_nodes_started_differently_or_alone_fail_with_the_reason(tmp_path):
    """Mismatched layouts are refused on both sides; a node whose node 0 never comes gives up
    at --dist-timeout naming the address."""
    from pathlib import Path

    from server import run_cli

    model_dir("v2_lite", tmp_path)
    addr = free_addr()
    base = ["--model", str(tmp_path), "--device", "cpu", "--tp", "2", "--dist-timeout", "20"]
    node1, log1 = start_node(1, addr, base + ["--enable-dp-attention"])
    r = run_cli(*base, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr, "--port", "0")
    assert r.returncode != 0 and "node 1 runs" in r.stderr, r.stderr
    assert node1.wait(timeout=30) != 0
    assert "refused" in Path(log1).read_text()

    lonely, log = start_node(1, free_addr(), base[:-2] + ["--dist-timeout", "2"])
    assert lonely.wait(timeout=30) != 0
    assert "not reachable within 2 s" in Path(log).read_text()
