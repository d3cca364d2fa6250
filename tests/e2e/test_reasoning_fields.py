"""How the reasoning of `--reasoning-parser` is reported, as vLLM and SGLang clients ask for it:
vLLM's `reasoning` beside `reasoning_content`, `include_reasoning`, SGLang's
`separate_reasoning` and `stream_reasoning`.

The demo model's random text never closes its thinking block, so a reply is all reasoning. With
`include_reasoning: false` a constraint applies from the first token (vLLM's rule), which lets
a regex write a reply with a thinking block, `ab</think>cd`, through the real parser.
"""

import json

import pytest
import requests

from server import Server

MSG = [{"role": "user", "content": "Think, then answer."}]
THOUGHT = {"guided_regex": "ab</think>cd", "include_reasoning": False}


@pytest.fixture(scope="module")
def r1():
    server = Server("--max-model-len", "1024", "--reasoning-parser", "deepseek_r1")
    yield server
    server.stop()


def chat(server, **body):
    r = requests.post(server.base + "/v1/chat/completions", json={"model": "demo", "messages": MSG, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, **body):
    r = requests.post(
        server.base + "/v1/chat/completions",
        json={"model": "demo", "messages": MSG, "stream": True, **body},
        stream=True,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    chunks = [json.loads(l[6:]) for l in (b.decode() for b in r.iter_lines()) if l.startswith("data: {")]
    return [c["choices"][0]["delta"] for c in chunks if c["choices"]]


def test_reasoning_is_sent_under_both_names(r1):
    m = chat(r1, max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]["message"]
    assert m["reasoning"] and m["reasoning"] == m["reasoning_content"]
    assert m["content"] is None, "random text never ends its thinking block"
    deltas = stream(r1, max_tokens=12, temperature=0, ignore_eos=True)
    assert all("reasoning_content" in d for d in deltas), "SGLang sends the key in every delta"
    assert "".join(d.get("reasoning") or "" for d in deltas) == m["reasoning"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


def test_include_reasoning_false_drops_it_and_constrains_from_the_first_token(r1):
    m = chat(r1, max_tokens=16, **THOUGHT)["choices"][0]["message"]
    assert (m["content"], m["reasoning"], m["reasoning_content"]) == ("cd", None, None)
    deltas = stream(r1, max_tokens=16, **THOUGHT)
    assert "".join(d.get("content") or "" for d in deltas) == "cd"
    assert not any(d.get("reasoning") or d.get("reasoning_content") for d in deltas)
    # Logprobs would show the hidden reasoning's tokens: vLLM leaves them out too.
    assert chat(r1, max_tokens=16, logprobs=True, **THOUGHT)["choices"][0]["logprobs"] is None


def test_separate_reasoning_false_keeps_the_thinking_in_content(r1, client):
    m = chat(r1, max_tokens=16, separate_reasoning=False, **THOUGHT)["choices"][0]["message"]
    assert (m["content"], m["reasoning_content"]) == ("ab</think>cd", None)
    unparsed = client.chat.completions.create(
        model="demo", messages=MSG, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    m = chat(r1, max_tokens=12, temperature=0, ignore_eos=True, separate_reasoning=False)["choices"][0]["message"]
    assert m["content"] == unparsed.choices[0].message.content and m["reasoning"] is None
    deltas = stream(r1, max_tokens=12, temperature=0, ignore_eos=True, separate_reasoning=False)
    assert "".join(d.get("content") or "" for d in deltas) == m["content"]


def test_stream_reasoning_false_sends_the_reasoning_in_one_piece(r1):
    whole = chat(r1, max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]["message"]["reasoning"]
    deltas = stream(r1, max_tokens=12, temperature=0, ignore_eos=True, stream_reasoning=False)
    pieces = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    assert pieces == [whole]
