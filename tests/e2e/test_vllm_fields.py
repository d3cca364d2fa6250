"""vLLM's request fields and response keys beyond OpenAI's, through the real binary.

References are independent of the server: the demo tokenizer through HF's `tokenizers` for
token ids, the prompt ids the test itself sent, and raw HTTP where key order or presence is what
is checked (the SDK hides both).
"""

from pathlib import Path

import pytest
import requests
import tokenizers

from server import ROOT

DEMO_TOKENIZER = tokenizers.Tokenizer.from_file(str(Path(ROOT) / "assets" / "demo" / "tokenizer.json"))
GREEDY = {"temperature": 0}


def post(demo, path, body):
    return requests.post(demo.base + path, json={"model": "demo", **body}, timeout=60)


def test_null_keys_a_client_reads_without_asking(demo):
    chat = post(demo, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    choice = chat["choices"][0]
    assert choice["token_ids"] is None
    assert choice["message"]["reasoning"] is None and choice["message"]["reasoning_content"] is None
    cmpl = post(demo, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).json()
    for key in ("prompt_logprobs", "prompt_token_ids", "token_ids"):
        assert key in cmpl["choices"][0] and cmpl["choices"][0][key] is None, key


def test_return_token_ids_on_completions(client):
    prompt = "Complete this sentence: I love coding"
    r = client.completions.create(
        model="demo", prompt=prompt, max_tokens=6, extra_body={"return_token_ids": True, "ignore_eos": True}, **GREEDY
    )
    c = r.choices[0]
    # The tokenizer adds BOS (id 0) to text prompts, as HF's does with add_special_tokens.
    assert c.prompt_token_ids == DEMO_TOKENIZER.encode(prompt, add_special_tokens=True).ids
    assert len(c.token_ids) == r.usage.completion_tokens == 6
    assert DEMO_TOKENIZER.decode(c.token_ids, skip_special_tokens=True) == c.text
    streamed_prompt, streamed_ids = None, []
    for chunk in client.completions.create(
        model="demo", prompt=prompt, max_tokens=6, stream=True, logprobs=1,
        extra_body={"return_token_ids": True, "ignore_eos": True}, **GREEDY,
    ):
        extra = chunk.choices[0].model_extra
        # vLLM's clients read every chunk's logprobs: each chunk carries a token.
        assert chunk.choices[0].logprobs is not None and extra.get("token_ids")
        if extra.get("prompt_token_ids") is not None:
            assert streamed_prompt is None, "the prompt ids come once, with the first token"
            streamed_prompt = extra["prompt_token_ids"]
        streamed_ids += extra.get("token_ids") or []
    assert streamed_prompt == c.prompt_token_ids and streamed_ids == c.token_ids


def test_return_token_ids_on_chat(client):
    messages = [{"role": "user", "content": "Hello!"}]
    r = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=5, extra_body={"return_token_ids": True, "ignore_eos": True}, **GREEDY
    )
    prompt_ids = r.model_extra["prompt_token_ids"]
    assert len(prompt_ids) == r.usage.prompt_tokens
    assert DEMO_TOKENIZER.decode(prompt_ids, skip_special_tokens=False) == "<｜begin▁of▁sentence｜><｜User｜>Hello!<｜Assistant｜>"
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == 5 and DEMO_TOKENIZER.decode(ids, skip_special_tokens=True) == r.choices[0].message.content
    first, streamed = None, []
    for chunk in client.chat.completions.create(
        model="demo", messages=messages, max_tokens=5, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True}, **GREEDY,
    ):
        if first is None:
            first = chunk.model_extra.get("prompt_token_ids")
        if chunk.choices:
            streamed += chunk.choices[0].model_extra.get("token_ids") or []
    assert first == prompt_ids and streamed == ids


@pytest.mark.parametrize("side, expected", [("right", [2, 3, 4, 5]), ("left", [6, 7, 8, 9]), (None, [6, 7, 8, 9])])
def test_truncate_prompt_tokens_keeps_the_side_asked_for(client, side, expected):
    extra = {"return_token_ids": True, "truncate_prompt_tokens": 4}
    if side:
        extra["truncation_side"] = side
    r = client.completions.create(model="demo", prompt=list(range(2, 10)), max_tokens=1, extra_body=extra, **GREEDY)
    assert r.choices[0].prompt_token_ids == expected and r.usage.prompt_tokens == 4


def test_truncate_prompt_tokens_limits(demo):
    # The server runs with --max-model-len 1024: a prompt may keep at most 1024 - max_tokens.
    long_prompt = list(range(3, 500)) * 3
    r = post(demo, "/v1/completions", {"prompt": long_prompt, "max_tokens": 24, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1000
    r = post(demo, "/v1/completions", {"prompt": [5, 6], "max_tokens": 24, "truncate_prompt_tokens": 1001})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    r = post(demo, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "a long question " * 400}], "max_tokens": 8, "truncate_prompt_tokens": 16,
    })
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16


def test_allowed_token_ids_restrict_every_draw(client):
    allowed = [65, 66, 300]
    r = client.completions.create(
        model="demo", prompt="x", max_tokens=12, n=4, temperature=1.5, seed=7,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    )
    for c in r.choices:
        assert len(c.token_ids) == 12 and set(c.token_ids) <= set(allowed), c.token_ids
        # EOS is not among them, so nothing could end the completion early.
        assert c.finish_reason == "length"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [512]}, "allowed_token_ids"),
        ({"allowed_token_ids": [65], "guided_regex": "a+"}, "allowed_token_ids"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"logprob_token_ids": [5], "logprobs": 1}, "logprob_token_ids"),
        ({"truncation_side": "middle"}, "truncation_side"),
    ],
)
def test_fields_without_the_feature_are_400s_naming_them(demo, body, param):
    r = post(demo, "/v1/completions", {"prompt": "x", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert param in r.json()["error"]["message"]


def test_top_logprobs_put_the_chosen_token_first_then_by_rank(demo):
    r = post(demo, "/v1/completions", {
        "prompt": "Once", "max_tokens": 12, "logprobs": 5, "temperature": 1.5, "seed": 3, "ignore_eos": True,
        # Ids as names: byte-level pieces of one character share the text "\ufffd".
        "return_tokens_as_token_ids": True,
    }).json()
    lp = r["choices"][0]["logprobs"]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        entries = list(top.items())  # JSON object order, as sent
        assert entries[0] == (token, logprob)
        rest = [v for _, v in entries[1:]]
        assert rest == sorted(rest, reverse=True)


def test_a_custom_role_reaches_the_template(demo):
    r = post(demo, "/v1/chat/completions", {
        "messages": [{"role": "my-custom-role", "content": "aside"}, {"role": "user", "content": "hi"}], "max_tokens": 2,
    })
    assert r.status_code == 200, r.text


def test_chat_echo_prefixes_the_continued_message(client):
    messages = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello, my"}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=4, extra_body=extra, **GREEDY)
    plain = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=4, extra_body={**extra, "echo": False}, **GREEDY
    )
    assert r.choices[0].message.content == "Hello, my" + plain.choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="demo", messages=messages, max_tokens=4, stream=True, extra_body=extra, **GREEDY
        )
        if c.choices
    )
    assert streamed == r.choices[0].message.content
    # The final message is the user's: nothing to echo.
    r = client.chat.completions.create(
        model="demo", messages=messages[:1], max_tokens=4, extra_body={"echo": True, "ignore_eos": True}, **GREEDY
    )
    assert not r.choices[0].message.content.startswith("Say hello")


def test_every_streamed_chat_chunk_has_content_text(client):
    """A token whose text is held back (it could start a stop string) still streams its logprob,
    in a chunk whose content is "" rather than absent: SGLang's and vLLM's clients read it."""
    stops = [c + "!" for c in "etaoins "]
    chunks = list(client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=40, stream=True, logprobs=True,
        temperature=1.2, seed=11, stop=stops, stream_options={"include_usage": True},
    ))
    held = 0
    for c in chunks[:-1]:
        d, lp = c.choices[0].delta, c.choices[0].logprobs
        assert isinstance(d.content, str) or c.choices[0].finish_reason, c
        held += bool(lp and lp.content and d.content == "")
    tokens = sum(len(c.choices[0].logprobs.content) for c in chunks[:-1] if c.choices[0].logprobs)
    assert tokens == chunks[-1].usage.completion_tokens
    assert held, "some text was held back while it could start a stop string"

