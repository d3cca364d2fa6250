"""SGLang's request fields and response keys: matched_stop, the regex and ebnf constraints, and
the echo of token-id prompts. Raw HTTP, since the SDK does not expose these keys."""

import json
import re
from pathlib import Path

import pytest
import requests
import tokenizers

from server import ROOT

EOS = 1  # the demo tokenizer's <｜end▁of▁sentence｜>


def post(demo, path, body):
    return requests.post(demo.base + path, json={"model": "demo", **body}, timeout=60)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_matched_stop_names_what_ended_each_choice(demo, path):
    prompt = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    # Length: nothing matched.
    r = post(demo, path, {**prompt, "max_tokens": 3, "ignore_eos": True}).json()["choices"][0]
    assert r["finish_reason"] == "length" and r["matched_stop"] is None
    # EOS forced as the first token: its id (stop_reason stays null for EOS, as vLLM's).
    r = post(demo, path, {**prompt, "max_tokens": 5, "logit_bias": {str(EOS): 100}}).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["matched_stop"] == EOS and r["stop_reason"] is None
    # A requested stop token and a stop string.
    r = post(demo, path, {**prompt, "max_tokens": 5, "stop_token_ids": [77], "logit_bias": {"77": 100}}).json()
    assert r["choices"][0]["matched_stop"] == 77
    r = post(demo, path, {**prompt, "max_tokens": 8, "guided_regex": "ab(cd)+", "stop": ["c"]}).json()
    assert r["choices"][0]["matched_stop"] == "c" and r["choices"][0]["finish_reason"] == "stop"


def test_matched_stop_in_streamed_choices(demo):
    r = requests.post(
        demo.base + "/v1/completions",
        json={"model": "demo", "prompt": "x", "max_tokens": 5, "logit_bias": {str(EOS): 100}, "stream": True},
        stream=True,
        timeout=60,
    )
    chunks = [json.loads(l[6:]) for l in (b.decode() for b in r.iter_lines()) if l.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert all("matched_stop" in c for c in choices)
    assert choices[-1]["matched_stop"] == EOS


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_regex_field_constrains_the_output(demo, path):
    prompt = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = post(demo, path, {**prompt, "max_tokens": 40, "regex": "(yes|no), [0-9]{3}", "temperature": 1.2, "seed": 5})
    choice = r.json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert re.fullmatch(r"(yes|no), [0-9]{3}", text), text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"ebnf": 'root ::= "a"'}, "ebnf"),
        ({"regex": "a+", "guided_regex": "b+"}, "regex"),
        ({"regex": "(unclosed"}, "regex"),
    ],
)
def test_constraint_refusals_name_the_field(demo, body, param):
    r = post(demo, "/v1/completions", {"prompt": "x", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_of_token_prompts_leaves_the_encoding_bos_out(demo):
    tok = tokenizers.Tokenizer.from_file(str(Path(ROOT) / "assets" / "demo" / "tokenizer.json"))
    ids = tok.encode("hello world", add_special_tokens=True).ids
    assert ids[0] == 0, "BOS leads the prompt"
    r = post(demo, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 1, "ignore_eos": True}).json()
    # The echo is the text the ids encode, as SGLang returns it: without the BOS encoding added.
    assert r["choices"][0]["text"].startswith("hello world")
    # Special tokens the client put in itself stay, as text.
    r = post(demo, "/v1/completions", {"prompt": ids + [501], "echo": True, "max_tokens": 1, "ignore_eos": True}).json()
    assert r["choices"][0]["text"].startswith("hello world<｜User｜>")
