"""Speculative decoding with the MTP layer through the real binary, as users turn it on.

The v3_mtp fixture is the v3 fixture's exact model plus an MTP layer (tests/fixtures/README.md),
so HF transformers' greedy continuation of v3 (its oracle) judges the output: with vLLM's
`--speculative-config` or SGLang's `--speculative-algorithm` the server must still produce it,
prompts batched in one request, streamed one by one, and arriving while others decode. Greedy
requests with penalties and logit_bias draft and give what a server without speculation gives.
/metrics counts the drafts. Where speculative decoding cannot run, the server refuses to start
and says why. Tensor-parallel ranks (`--tp 2` on the CPU reference) draft and verify as one;
DP-attention ranks (`--tp 2 --enable-dp-attention`), each drafting for its own requests, give
the same output, on one node and on two (grammar requests included).
"""

import json
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server import ROOT, Server, free_addr, run_cli, start_node

FIXTURES = ROOT / "tests" / "fixtures"
DEMO = ROOT / "assets" / "demo"
NEAR_TIE = 1e-3
VLLM = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2})]
# Every step drafts: the measured load rule (on by default) stops drafting on the CPU, where the
# untrained layer's drafts do not stand and a verify step costs several plain ones, and these
# tests are about what drafting does. The default rule has its own case below.
ALWAYS = ["--speculative-load-rule", "off"]
SGLANG = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
# Drafting pauses while 2 or more sequences run: the batched request drafts only in its tail.
VLLM_PAUSED = [
    "--speculative-config",
    json.dumps({"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 2}),
]


def model_dir(tmp_path, variant):
    d = tmp_path / variant
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        (d / name).symlink_to(FIXTURES / variant / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, d / name)
    return d


def oracle():
    # v3_mtp's main model is v3's: v3's HF oracle is its oracle.
    return json.loads((FIXTURES / "v3" / "oracle.json").read_text())["prompts"]


def comparable(p):
    return next((i for i, g in enumerate(p["gaps"]) if g < NEAR_TIE), len(p["gaps"]))


def ids(choice):
    return [int(t.split(":")[1]) for t in choice.logprobs.tokens]


def greedy(client, prompts, **kw):
    r = client.completions.create(
        model="m",
        prompt=prompts,
        max_tokens=32,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        **kw,
    )
    return [ids(c) for c in sorted(r.choices, key=lambda c: c.index)]


DPA2 = ["--tp", "2", "--enable-dp-attention"]


@pytest.mark.parametrize(
    "flags",
    [VLLM, SGLANG + ALWAYS, VLLM_PAUSED + ALWAYS, VLLM + ALWAYS + ["--tp", "2"], VLLM + ALWAYS + DPA2,
     VLLM_PAUSED + ALWAYS + DPA2],
    ids=["vllm", "sglang", "vllm-paused", "vllm-tp2", "vllm-dpa2", "vllm-paused-dpa2"],
)
def test_greedy_output_with_mtp_is_hfs(flags, tmp_path):
    server = Server("--model", str(model_dir(tmp_path, "v3_mtp")), "--served-model-name", "m", "--device", "cpu", *flags)
    try:
        assert "speculative decoding: the MTP layer drafts" in server.log_text()
        if flags[:2] == VLLM_PAUSED:
            assert "paused while 2 or more sequences run" in server.log_text()
        client = server.client()
        prompts = oracle()
        batched = greedy(client, [p["prompt"] for p in prompts])
        with ThreadPoolExecutor(3) as pool:
            one_by_one = list(pool.map(lambda p: greedy(client, [p["prompt"]])[0], prompts))
        for p, got, alone in zip(prompts, batched, one_by_one):
            k = comparable(p)
            assert got[:k] == p["continuation"][:k], p["name"]
            assert alone == got, p["name"]
        # Streamed, with logprobs: the same tokens, each with its own logprob.
        stream = client.completions.create(
            model="m",
            prompt=prompts[1]["prompt"],
            max_tokens=32,
            temperature=0,
            logprobs=1,
            stream=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        streamed = [int(t.split(":")[1]) for ch in stream for t in ch.choices[0].logprobs.tokens]
        assert streamed == batched[1]
        m = server.metrics()
        assert m["mla:spec_decode_num_draft_tokens_total"] > 0
        assert m["mla:spec_decode_num_drafts_total"] > 0
        assert m["mla:spec_decode_num_accepted_tokens_total"] <= m["mla:spec_decode_num_draft_tokens_total"]
        if flags == VLLM:
            # The measured load rule (on by default): on the CPU a verify step costs several
            # plain ones and the untrained layer's drafts almost never stand, so it stops.
            assert "at each batch size only while it measures faster there" in server.log_text()
            assert "speculative decoding stops at" in server.log_text()
    finally:
        assert server.stop() == 0


def test_penalised_and_biased_requests_draft_and_match_the_server_without_speculation(tmp_path):
    """Requests with penalties and logit_bias draft on the CPU reference, each verify row shaped
    by the drafts before it: greedy ones give exactly what the server without speculation gives
    (a sampled one's draws differ by design; crates/mla-cpu/tests/speculative_sampling.rs checks
    its distribution), and a sampled one reproduces its tokens for its seed."""
    d = model_dir(tmp_path, "v3_mtp")
    prompts = [oracle()[0]["prompt"], oracle()[2]["prompt"]]
    shaping = {"repetition_penalty": 1.1, "presence_penalty": 0.4, "frequency_penalty": 0.2}
    outputs = []
    for flags in ([], VLLM + ALWAYS):
        server = Server("--model", str(d), "--served-model-name", "m", "--device", "cpu", *flags)
        try:
            client = server.client()
            r = client.completions.create(
                model="m",
                prompt=prompts,
                max_tokens=24,
                temperature=0.0,
                logprobs=0,
                logit_bias={"17": 3, "201": -100},
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **shaping},
            )
            outputs.append([ids(c) for c in sorted(r.choices, key=lambda c: c.index)])
            if flags:
                assert "drafts 2 token(s) per step for greedy and sampled requests" in server.log_text()
                assert "without penalties, logit_bias or a grammar" not in server.log_text()
                assert server.metrics()["mla:spec_decode_num_draft_tokens_total"] > 0

                def sampled():
                    r = client.completions.create(
                        model="m",
                        prompt=prompts[0],
                        max_tokens=24,
                        temperature=0.9,
                        seed=11,
                        logprobs=0,
                        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **shaping},
                    )
                    return ids(r.choices[0])

                first = sampled()
                assert len(first) == 24 and sampled() == first
        finally:
            assert server.stop() == 0
    assert outputs[0] == outputs[1]


STRUCTURED = {
    "regex": {"guided_regex": "[0-9]{2}(-[a-z]{2,5})+"},
    "choice": {"guided_choice": ["alpha beta gamma delta", "alpha beta gamma epsilon", "zeta"]},
    "json": {
        "guided_json": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "integer"}}},
            "required": ["name", "tags"],
        }
    },
}


@pytest.mark.parametrize("flags", [[], ["--tp", "2"], DPA2], ids=["one-rank", "tp2", "dpa2"])
def test_structured_requests_draft_and_match_the_server_without_speculation(flags, tmp_path):
    """Structured-output requests draft: each verify row draws under the grammar's mask after the
    drafts before it (the grammar followed along them and rolled back), so greedy outputs equal
    the server's without speculation token for token, whatever the layout, and every output
    keeps to its grammar."""
    d = model_dir(tmp_path, "v3_mtp")
    prompts = [oracle()[0]["prompt"], oracle()[2]["prompt"]]
    outputs = []
    for spec in ([], VLLM + ALWAYS):
        server = Server("--model", str(d), "--served-model-name", "m", "--device", "cpu", *flags, *spec)
        try:
            client = server.client()
            before = server.metrics().get("mla:spec_decode_num_draft_tokens_total", 0)
            got = {}
            for name, body in STRUCTURED.items():
                r = client.completions.create(
                    model="m",
                    prompt=prompts,
                    max_tokens=20,
                    temperature=0.0,
                    logprobs=0,
                    extra_body={"return_tokens_as_token_ids": True, **body},
                )
                got[name] = [(ids(c), c.text) for c in sorted(r.choices, key=lambda c: c.index)]
            outputs.append(got)
            if spec:
                drafted = server.metrics()["mla:spec_decode_num_draft_tokens_total"] - before
                assert drafted > 0, "structured requests drafted"
        finally:
            assert server.stop() == 0
    assert outputs[0] == outputs[1]
    for _, text in outputs[0]["choice"]:
        assert text in STRUCTURED["choice"]["guided_choice"]
    for _, text in outputs[0]["regex"]:
        assert text[:2].isdigit() and text[2] == "-", text


def test_sampled_requests_draft_and_reproduce_on_the_cpu_reference(tmp_path):
    """Sampled requests without penalties draft (rejection sampling keeps the target's
    distribution: crates/mla-cpu/tests/speculative_sampling.rs tests that statistically); the
    same seed gives the same tokens again, with n = 2, streamed or not, with logprobs."""
    server = Server("--model", str(model_dir(tmp_path, "v3_mtp")), "--served-model-name", "m", "--device", "cpu", *VLLM, *ALWAYS)
    try:
        assert "for greedy and sampled requests" in server.log_text()
        client = server.client()

        def sampled(**kw):
            r = client.completions.create(
                model="m",
                prompt=oracle()[1]["prompt"],
                max_tokens=24,
                temperature=0.8,
                top_p=0.95,
                seed=5,
                n=2,
                logprobs=2,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                **kw,
            )
            return r

        first, again = sampled(), sampled()
        assert [ids(c) for c in first.choices] == [ids(c) for c in again.choices]
        assert all(len(ids(c)) == 24 for c in first.choices)
        assert ids(first.choices[0]) != ids(first.choices[1]), "two completions of one seed differ"
        for c in first.choices:
            assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
            assert all(len(top) >= 1 for top in c.logprobs.top_logprobs)
        m = server.metrics()
        assert m["mla:spec_decode_num_draft_tokens_total"] > 0
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    "variant,extra,needle",
    [
        ("v3", [], "has no multi-token-prediction layer"),
        ("v3_mtp", ["--speculative-num-steps", "2"], "belongs with --speculative-algorithm"),
    ],
)
def test_where_it_cannot_run_the_server_says_why(variant, extra, needle, tmp_path):
    r = run_cli("--model", str(model_dir(tmp_path, variant)), "--device", "cpu", *VLLM[: 0 if "--speculative-num-steps" in extra else 2], *extra, "--port", "1")
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr


def test_two_nodes_with_dp_attention_draft_and_give_hfs_output(tmp_path):
    """Node 1 holds rank 1 of a DP-attention pair; both load the MTP layer and make every MTP
    pass together. A node started without the speculative flags is refused at the rendezvous."""
    d = model_dir(tmp_path, "v3_mtp")
    common = ["--model", str(d), "--device", "cpu", *DPA2, *VLLM, *ALWAYS]
    addr = free_addr()
    node1, _ = start_node(1, addr, common)
    server = Server(*common, "--served-model-name", "m", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr)
    try:
        client = server.client()
        prompts = oracle()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(lambda p: greedy(client, [p["prompt"]])[0], prompts * 2))
        for p, got in zip(prompts * 2, outputs):
            k = comparable(p)
            assert got[:k] == p["continuation"][:k], p["name"]
        assert server.metrics()["mla:spec_decode_num_draft_tokens_total"] > 0
        # Grammar requests draft across the nodes too: a verify step's masks (a row per verify
        # row) travel to node 1 with its plan once they exist.
        before = server.metrics()["mla:spec_decode_num_draft_tokens_total"]
        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda p: client.with_options(timeout=30).completions.create(
                model="m", prompt=p["prompt"], max_tokens=20, temperature=0, extra_body=STRUCTURED["regex"],
            ).choices[0].text, prompts * 2))
        # Cut by max_tokens or complete, every text follows the grammar from its start.
        assert all(re.match("[0-9]{2}-[a-z]{2}", t) for t in texts), texts
        assert time.monotonic() - started < 20
        assert server.metrics()["mla:spec_decode_num_draft_tokens_total"] > before
    finally:
        assert server.stop() == 0
    node1.wait(timeout=30)

    addr = free_addr()
    plain = ["--model", str(d), "--device", "cpu", *DPA2, "--dist-timeout", "20"]
    node1, _ = start_node(1, addr, plain)
    r = run_cli(*plain, *VLLM, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr, "--port", "0")
    assert r.returncode != 0 and "node 1 runs" in r.stderr, r.stderr
    assert node1.wait(timeout=30) != 0
