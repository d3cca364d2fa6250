"""/v1/completions: every prompt form, echo, logprobs, streaming."""


def test_default_max_tokens_is_16(client):
    r = client.completions.create(model="demo", prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_prompt_forms_and_choice_numbering(client):
    extra = {"ignore_eos": True}
    r = client.completions.create(model="demo", prompt=["a", "b", "c"], max_tokens=2, temperature=0, extra_body=extra)
    assert [c.index for c in r.choices] == [0, 1, 2]
    r = client.completions.create(model="demo", prompt=[0, 17, 42, 99], max_tokens=3, temperature=0, extra_body=extra)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 3
    r = client.completions.create(
        model="demo", prompt=[[0, 5, 6], [0, 7]], n=2, max_tokens=3, temperature=0, extra_body=extra
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    # Same prompt ids, greedy: identical choices; different prompts: the model sees them.
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text


def test_token_prompts_continue_exactly(client):
    """Greedy continuation of prompt + its first 4 generated ids is the rest of the original
    continuation: token-id prompts reach the model unchanged (ids read back as `token_id:N`)."""

    def continuation(prompt, k):
        r = client.completions.create(
            model="demo", prompt=prompt, max_tokens=k, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]

    prompt = [0, 101, 202, 303, 404]
    first = continuation(prompt, 8)
    assert len(first) == 8
    assert continuation(prompt + first[:4], 4) == first[4:]


def test_echo_logprobs_and_stream(client):
    r = client.completions.create(model="demo", prompt="Echo me", echo=True, max_tokens=4, temperature=0)
    assert r.choices[0].text.startswith("Echo me")
    r = client.completions.create(model="demo", prompt="x", logprobs=2, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    chunks = list(
        client.completions.create(
            model="demo", prompt="x", max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5
