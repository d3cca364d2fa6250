"""/v1/chat/completions through the official OpenAI SDK against the demo model."""

MSG = [{"role": "user", "content": "Tell me about latent attention."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_non_streaming_shape_and_usage(client):
    r = client.chat.completions.create(model="demo", messages=MSG, max_tokens=12, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "demo"
    (c,) = r.choices
    assert c.index == 0 and c.message.role == "assistant" and c.finish_reason == "length"
    assert isinstance(c.message.content, str) and c.message.content
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_stream_equals_non_stream_and_reports_usage(client):
    full = client.chat.completions.create(model="demo", messages=MSG, max_tokens=10, **GREEDY)
    stream = client.chat.completions.create(
        model="demo", messages=MSG, max_tokens=10, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_n2_gives_two_indexed_choices(client):
    r = client.chat.completions.create(model="demo", messages=MSG, max_tokens=5, n=2, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    # Greedy decoding: both samples are the same text.
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens == 10


def test_stop_string_cuts_the_text(client):
    full = client.chat.completions.create(model="demo", messages=MSG, max_tokens=40, **GREEDY).choices[0].message.content
    # A stop string taken from the middle of the greedy text (avoiding replacement characters).
    start = next(i for i in range(8, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    stop = full[start : start + 3]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        r = client.chat.completions.create(model="demo", messages=MSG, max_tokens=40, stop=[stop], stream=stream, **GREEDY)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert (text, finish) == (cut, ["stop"])
        else:
            assert (r.choices[0].message.content, r.choices[0].finish_reason) == (cut, "stop")
            assert r.usage.completion_tokens < 40


def test_logprobs_are_consistent_with_greedy_choice(client):
    r = client.chat.completions.create(model="demo", messages=MSG, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for t in content:
        assert len(t.top_logprobs) == 3
        tops = [a.logprob for a in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and tops[0] <= 0
        # Greedy: the chosen token is the most likely one.
        assert abs(t.logprob - tops[0]) < 1e-6
        if "\ufffd" not in t.token:
            assert bytes(t.bytes) == t.token.encode()
    # Tokens holding part of a UTF-8 character print as U+FFFD alone; otherwise they add up.
    text = r.choices[0].message.content
    if "\ufffd" not in text and all("\ufffd" not in t.token for t in content):
        assert "".join(t.token for t in content) == text
    # Their bytes always add up to the text's bytes.
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", errors="replace") == text


def test_seed_reproducibility(client):
    def sample(seed):
        return client.chat.completions.create(
            model="demo", messages=MSG, max_tokens=20, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
        ).choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_unset_max_tokens_means_rest_of_context(demo, client):
    r = client.chat.completions.create(model="demo", messages=MSG, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 1024  # the server runs with --max-model-len 1024


def test_content_parts_and_system_messages(client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
    ]
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3


def test_developer_role_is_rendered_as_system(client):
    """OpenAI's `developer` role is its newer name for `system`: the same prompt, so the same
    prompt token count and the same greedy reply."""
    def ask(role):
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]
        return client.chat.completions.create(model="demo", messages=messages, max_tokens=4, **GREEDY)

    as_system, as_developer = ask("system"), ask("developer")
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
