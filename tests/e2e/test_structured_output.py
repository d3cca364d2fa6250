"""Structured output (issue 15): with the grammar enforcing every token, even the random-weight
demo model answers text that parses and validates. Schemas bound their strings and numbers so
that a model with no idea what it is writing still finishes well inside max_tokens."""

import json
import re
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 400


class Person(BaseModel):
    name: Annotated[str, Field(max_length=6)]
    age: Annotated[int, Field(ge=0, le=120)]
    mood: Literal["happy", "sad", "calm"]
    tags: Annotated[list[Literal["a", "b"]], Field(max_length=3)]


SAMPLINGS = [dict(temperature=0), dict(temperature=1.0, seed=7), dict(temperature=1.0, seed=123)]
SAMPLING_IDS = ["greedy", "seed7", "seed123"]


def chat(client, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="demo", messages=MESSAGES, **kw)


def parse_method(client):
    """`client.chat.completions.parse` in newer SDKs, `client.beta.chat.completions.parse` before."""
    parse = getattr(client.chat.completions, "parse", None)
    return parse or client.beta.chat.completions.parse


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_sdk_parse_with_a_pydantic_model(client, sampling):
    r = parse_method(client)(
        model="demo", messages=MESSAGES, response_format=Person, max_tokens=MAX_TOKENS, **sampling
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    person = choice.message.parsed
    assert isinstance(person, Person)
    assert Person.model_validate_json(choice.message.content) == person


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_json_object(client, sampling):
    # Any object: nothing bounds it, so the compact form and a generous budget; a cut-off object
    # is allowed by the contract ("length"), a stopped one must parse.
    r = chat(
        client,
        response_format={"type": "json_object"},
        max_tokens=1000,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
        **sampling,
    )
    c = r.choices[0]
    assert c.message.content.startswith("{")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.finish_reason == "length"


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_guided_regex_completions(client, sampling):
    pattern = r"(Mr|Ms)\. [A-Z][a-z]{1,8}, [0-9]{2} years"
    r = client.completions.create(
        model="demo", prompt="Name and age:", max_tokens=60, extra_body={"guided_regex": pattern}, **sampling
    )
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert re.fullmatch(pattern, c.text), c.text


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_guided_choice(client, sampling):
    choices = ["positive", "negative", "neutral (unsure)"]
    r = chat(client, extra_body={"guided_choice": choices}, **sampling)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content in choices


def test_guided_grammar_lark(client):
    grammar = """
start: expr
expr: NUMBER | "(" expr OP expr ")"
OP: "+" | "-" | "*"
NUMBER: /[1-9]/
"""
    for sampling in SAMPLINGS:
        r = chat(client, extra_body={"guided_grammar": grammar}, **sampling)
        c = r.choices[0]
        text = c.message.content
        if c.finish_reason == "stop":
            # A tiny evaluator doubles as the parse check: it fails on anything off-grammar.
            assert isinstance(eval(text, {"__builtins__": {}}), int), text  # noqa: S307
        assert re.fullmatch(r"[0-9()+\-* ]*", text), text


def test_structured_outputs_field_and_completions_response_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = chat(client, temperature=0, extra_body={"structured_outputs": {"json": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    # vLLM takes response_format on /v1/completions too.
    r = client.completions.create(
        model="demo",
        prompt="Answer:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text)["ok"], bool)


def test_streaming_with_response_format(client):
    schema = Person.model_json_schema()
    stream = chat(
        client,
        stream=True,
        temperature=1.0,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    Person.model_validate_json(text)


def test_n_completions_each_valid(client):
    r = parse_method(client)(
        model="demo", messages=MESSAGES, response_format=Person, max_tokens=MAX_TOKENS, n=4, temperature=1.0, seed=9
    )
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == "stop"
        assert isinstance(c.message.parsed, Person)
    assert len({c.message.content for c in r.choices}) > 1, "n samples should differ"


def test_max_tokens_cuts_json_with_length(client):
    r = chat(client, max_tokens=3, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("{")


def test_ignore_eos_keeps_the_text_valid(client):
    # After the grammar ends only EOS may be drawn; ignore_eos draws it (as text, nothing) until
    # max_tokens.
    r = chat(client, max_tokens=40, temperature=0, extra_body={"guided_choice": ["yes", "no"], "ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 40
    assert c.message.content in ("yes", "no")


def test_min_tokens_does_not_break_a_finished_grammar(client):
    r = chat(client, temperature=0, extra_body={"guided_choice": ["yes", "no"], "min_tokens": 10})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}}, "response_format"),
        ({"guided_regex": "([a-z]"}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
    ],
    ids=["bad-schema", "bad-response-format-schema", "bad-regex", "bad-grammar", "two-constraints", "rf-and-regex", "no-choices"],
)
def test_invalid_constraints_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body=extra)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
