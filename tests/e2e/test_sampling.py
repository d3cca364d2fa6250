"""Sampling fields reach the sampler: checked against properties that hold whatever the weights."""

import pytest

PROMPT = [0, 5, 9]


def ids(client, n=1, **kw):
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True, **kw.pop("extra_body", {})}
    r = client.completions.create(model="demo", prompt=PROMPT, logprobs=0, n=n, extra_body=extra, **kw)
    out = [[int(t.split(":")[1]) for t in c.logprobs.tokens] for c in sorted(r.choices, key=lambda c: c.index)]
    return out[0] if n == 1 else out


@pytest.mark.parametrize(
    "filters",
    [{"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1.0}}, {"top_p": 1e-6}],
    ids=["top_k=1", "min_p=1", "top_p~0"],
)
def test_filters_that_keep_one_token_are_greedy(client, filters):
    greedy = ids(client, max_tokens=24, temperature=0)
    sampled = ids(client, max_tokens=24, temperature=1.0, seed=3, **filters)
    assert sampled == greedy


@pytest.mark.parametrize(
    "penalty",
    [{"extra_body": {"repetition_penalty": 2.0}}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}],
    ids=["repetition", "frequency", "presence"],
)
def test_penalties_reduce_repetition(client, penalty):
    plain = ids(client, max_tokens=300, temperature=0)
    penalised = ids(client, max_tokens=300, temperature=0, **penalty)
    # The demo model loops when decoding greedily; a penalty on seen tokens breaks the loops.
    assert len(set(plain)) < 250
    assert len(set(penalised)) > len(set(plain))


def test_n_samples_differ_but_reproduce_with_a_seed(client):
    a = ids(client, n=3, max_tokens=16, temperature=1.0, seed=11)
    b = ids(client, n=3, max_tokens=16, temperature=1.0, seed=11)
    assert a == b
    assert len({tuple(x) for x in a}) == 3


def test_logit_bias_forces_and_bans_tokens(client):
    greedy = ids(client, max_tokens=8, temperature=0)
    forced = 100 if greedy[0] != 100 else 101
    assert ids(client, max_tokens=8, temperature=0, logit_bias={str(forced): 100}) == [forced] * 8
    banned = ids(client, max_tokens=8, temperature=0, logit_bias={str(t): -100 for t in set(greedy)})
    assert not set(banned) & set(greedy)
    sampled = ids(client, max_tokens=32, temperature=1.0, seed=5, logit_bias={str(forced): 100})
    assert sampled == [forced] * 32


def test_min_tokens_holds_off_the_stop_token(client):
    first = ids(client, max_tokens=1, temperature=0)[0]
    stop = {"stop_token_ids": [first], "ignore_eos": False}
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=20, temperature=0, extra_body=stop)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (1, "stop")
    r = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=20, temperature=0, extra_body={**stop, "min_tokens": 6}
    )
    assert r.usage.completion_tokens >= 6


@pytest.mark.parametrize(
    "body", [{"logit_bias": {"x": 1}}, {"logit_bias": {"3": 101}}, {"min_tokens": 9, "max_tokens": 4}]
)
def test_bad_logit_bias_and_min_tokens_are_400(client, body):
    import openai

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt=PROMPT, extra_body=body, **({} if "max_tokens" in body else {"max_tokens": 4}))


def test_min_tokens_holds_off_stop_strings(client):
    base = {"model": "demo", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    text = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[:2]
    assert len(stop) == 2, text
    r = client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 8
    r = client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 8})
    # As vLLM: stop strings count only from token 9 on, so the text starts as without the stop.
    assert r.usage.completion_tokens >= 8 and r.choices[0].text.startswith(stop)
