"""The binary's flags: unimplemented features fail at start with a reason; shutdown is graceful."""

import signal
import socket
import threading
import time

import pytest
import requests

from server import Server, run_cli


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--device", "cuda"], "CUDA backend"),
        # The demo's MLA dims are not the CUDA kernels' (and CI has no GPU): a clear refusal.
        (["--device", "cuda"], "CUDA"),
        # The demo's moe_intermediate_size is 64: --tp 3 does not split it.
        (["--device", "cpu", "--tp", "3"], "moe_intermediate_size (64) does not split over 3 ranks"),
        (["--enable-dp-attention"], "--tp 2 or more"),
        (["--tp", "4", "--dp", "2", "--enable-dp-attention"], "attention-TP groups"),
        (["--tp", "2", "--nnodes", "2"], "needs --dist-init-addr"),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:1"], "--node-rank 2"),
        (["--device", "cpu", "--gpu-memory-utilization", "0.9"], "cuda only"),
        # auto falls back to the CPU for the demo (its dims are not the kernels'), so a GPU-only
        # flag must not be silently dropped.
        (["--gpu-memory-utilization", "0.9"], "--device auto chose cpu"),
        (["--model", "deepseek-v2-lite"], "--load-format dummy"),
        (["--model", "no-such-thing"], "not a directory"),
        (["--max-model-len", "999999"], "max_position_embeddings"),
        (["--load-format", "magic"], "invalid value"),
        (["--frobnicate"], "unexpected argument"),
        (["--hf-overrides", '{"num_hidden_layers": "six"}'], "with --hf-overrides: field `num_hidden_layers`"),
        (["--hf-overrides", '{"no_such_field": 1}'], "does not read this config field"),
        (["--hf-overrides", "[1]"], "must be a JSON object"),
        (["--timeout-keep-alive", "0"], "--timeout-keep-alive must be a positive"),
        (["--max-connections", "0"], "--max-connections must be at least 1"),
        (["--dtype", "float16"], "--dtype float16: the cpu backend computes in float32 only"),
        (["--dtype", "bf16"], "--dtype bfloat16: the cpu backend computes in float32 only"),
        (["demo-a", "--model", "demo-b"], "the model is given twice"),
        (["--chat-template", "/no/such/file"], "not a Jinja template"),
        (["--quantization", "awq"], "--quantization awq: not implemented; `fp8`"),
        (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2: only fp8 (fp8_e4m3)"),
        (["--kv-cache-dtype", "int8"], "--kv-cache-dtype int8: expected auto, fp8 or fp8_e4m3"),
        (["--kv-cache-dtype", "bfloat16"], "the cpu backend's cache holds float32 (auto) or fp8"),
    ],
)
def test_bad_flags_fail_at_start(args, needle):
    r = run_cli(*args, "--port", "1")
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr


def test_missing_hf_repo_lists_where_it_looked(tmp_path):
    r = run_cli("--model", "someorg/somemodel", env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": ""})
    assert r.returncode != 0
    assert str(tmp_path / "hf" / "hub" / "models--someorg--somemodel") in r.stderr, r.stderr


def test_hf_cache_repo_id_resolves(tmp_path):
    from server import ROOT

    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (snap / name).symlink_to(ROOT / "tests" / "fixtures" / "v3" / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (snap / name).symlink_to(ROOT / "assets" / "demo" / name)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    server = Server("--model", "acme/tiny", env={"HF_HOME": str(tmp_path), "HF_HUB_CACHE": ""})
    try:
        assert [m.id for m in server.client().models.list().data] == ["acme/tiny"]
    finally:
        server.stop()


def test_startup_log_and_help():
    r = run_cli("--help")
    assert r.returncode == 0
    for flag in ["--model", "--served-model-name", "--port", "--device", "--tp", "--dp", "--enable-dp-attention",
                 "--nnodes", "--node-rank", "--dist-init-addr", "--max-model-len",
                 "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--kv-cache-tokens",
                 "--load-format", "--chat-template", "--api-key", "--max-queued-requests", "--seed", "--log-level"]:
        assert flag in r.stdout, flag
    server = Server("--max-model-len", "256")
    try:
        log = server.log_text()
        for needle in ["demo", "nonsense", "parameters", "device: cpu", "parallel layout: one device", "KV cache:", "tokens", f":{server.port}"]:
            assert needle in log, (needle, log)
    finally:
        server.stop()


def test_sigterm_finishes_in_flight_requests_and_exits_0():
    server = Server("--max-model-len", "2048", "--shutdown-timeout", "20")
    client = server.client()
    result = {}

    started = threading.Event()

    def long_request():
        stream = client.completions.create(
            model="demo", prompt="x", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = []
        for c in stream:
            chunks.append(c)
            started.set()
        result["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]

    t = threading.Thread(target=long_request)
    t.start()
    # Signal once the request is streaming, so it is in flight however fast the machine is.
    assert started.wait(timeout=30)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(requests.ConnectionError):
        requests.get(server.base + "/health", timeout=2)
    t.join(timeout=60)
    assert result.get("finish") == ["length"], "the in-flight request ran to completion"
    assert server.proc.wait(timeout=60) == 0


def test_idle_keep_alive_connections_do_not_hold_shutdown():
    # Pooled clients (the openai SDK, requests.Session) keep idle connections open; closing one
    # at shutdown used to wait the whole 5 s lingering close for the client to hang up.
    server = Server()
    idle = []
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200"), "the connection is served and kept alive"
        idle.append(s)
    signalled = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0
    took = time.perf_counter() - signalled
    for s in idle:
        s.close()
    assert took < 2.5, f"shutdown took {took:.1f} s with idle keep-alive connections open"


def test_sigint_aborts_what_does_not_finish_in_time():
    server = Server("--max-model-len", "4096", "--shutdown-timeout", "0.5")
    client = server.client()
    stream = client.completions.create(
        model="demo", prompt="x", max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    assert first.choices
    start = time.time()
    server.proc.send_signal(signal.SIGINT)
    finishes = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert finishes == ["abort"]
    assert server.proc.wait(timeout=30) == 0
    assert time.time() - start < 15


def test_chat_template_override(tmp_path):
    """A template that renders only the first message's text (no BOS): the chat prompt is then
    one token shorter than the same text as a completions prompt, which gets BOS."""
    template = tmp_path / "plain.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    server = Server("--chat-template", str(template), "--max-model-len", "256")
    try:
        client = server.client()
        chat = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hello there"}], max_tokens=1
        )
        plain = client.completions.create(model="demo", prompt="hello there", max_tokens=1)
        assert chat.usage.prompt_tokens == plain.usage.prompt_tokens - 1
    finally:
        server.stop()


def test_hf_overrides_change_the_served_model():
    # A V3-shaped preset cut to one layer, as one would fit V3 on one GPU for a benchmark.
    server = Server("--model", "test-v3", "--load-format", "dummy", "--hf-overrides", '{"num_hidden_layers": 1}')
    try:
        assert "overridden by --hf-overrides" in server.log_text() and ": 1 layers" in server.log_text()
        reply = server.client().completions.create(model="test-v3", prompt=[1, 2, 3], max_tokens=2)
        assert reply.usage.completion_tokens == 2
    finally:
        server.stop()


def test_quantization_fp8_serves_the_block_fp8_model():
    # vLLM's flag: the demo's bf16 weights become block-FP8 on load; on the CPU the reference
    # backend computes their exact dequantization (the GPU computes in FP8).
    server = Server("--quantization", "fp8", "--max-model-len", "256")
    try:
        assert "linear weights quantized to block FP8 (--quantization fp8)" in server.log_text()
        reply = server.client().completions.create(model="demo", prompt=[1, 2, 3], max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
    finally:
        server.stop()


def test_a_busy_port_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = run_cli("--port", str(busy.getsockname()[1]))
    assert r.returncode != 0
    assert "cannot listen on" in r.stderr, r.stderr
    # Refused before any weights were loaded or the engine started.
    assert "loading" not in r.stderr and "engine started" not in r.stderr, r.stderr


def test_a_second_signal_during_shutdown_exits_at_once():
    server = Server("--max-model-len", "4096", "--shutdown-timeout", "60")
    client = server.client()
    stream = client.completions.create(
        model="demo", prompt="x", max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    assert next(iter(stream)).choices
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert server.proc.poll() is None, "the first signal drains for up to 60 s"
    server.proc.send_signal(signal.SIGINT)
    # 128 + SIGINT, as a shell reports it, within moments instead of the 60 s grace.
    assert server.proc.wait(timeout=10) == 128 + signal.SIGINT
    assert "again: exiting now" in server.log_text()


@pytest.mark.parametrize("disabled", [False, True])
def test_periodic_stats_line_while_busy(disabled):
    server = Server("--max-model-len", "2048", *(["--disable-log-stats"] if disabled else []))
    try:
        client = server.client()
        deadline = time.time() + 6  # one 5 s interval with work in it
        while time.time() < deadline:
            client.completions.create(model="demo", prompt="x", max_tokens=16, extra_body={"ignore_eos": True})
        time.sleep(0.5)
        stats = [line for line in server.log_text().splitlines() if "generation" in line and "tok/s, running" in line]
        if disabled:
            assert stats == []
        else:
            assert stats and "KV cache" in stats[0] and "prefix cache hit rate" in stats[0], stats
    finally:
        server.stop()


def test_vllm_command_lines_work():
    """`vllm serve MODEL ...` pasted with mla-serve in front: positional model, several served
    names, --trust-remote-code, --dtype auto, an inline chat template, --disable-log-requests."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    server = Server(
        "serve", "test-v3", "--load-format", "dummy", "--served-model-name", "first", "second",
        "--trust-remote-code", "--dtype", "auto", "--chat-template", template, "--disable-log-requests",
    )
    try:
        client = server.client()
        cards = client.models.list().data
        assert [m.id for m in cards] == ["first", "second"]
        # vLLM's root is the --model value (its bench client takes the tokenizer from it).
        assert {m.root for m in cards} == {"test-v3"} and all(m.parent is None for m in cards)
        reply = client.chat.completions.create(
            model="second", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.model == "first" and reply.usage.completion_tokens == 2
        # The inline template rendered the prompt as the bare message text: the tokens of "hi",
        # which a completion prompt has too, after its BOS.
        plain = client.completions.create(model="first", prompt="hi", max_tokens=1)
        assert reply.usage.prompt_tokens == plain.usage.prompt_tokens - 1
        log = server.log_text()
        assert "--trust-remote-code: DeepSeek-V2/V3 need no remote code" in log
        # vLLM's request log prints prompts, which mla-serve never logs: the flag says so, and the
        # access log (no contents) stays on, as uvicorn's does in vLLM.
        assert "--disable-log-requests: mla-serve logs no prompts" in log
        assert '"POST /v1/chat/completions" 200 ' in log
    finally:
        server.stop()
