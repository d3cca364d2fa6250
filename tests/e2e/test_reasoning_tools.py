"""Reasoning content and tool calls through the official OpenAI SDK.

The demo model writes random text, so these tests check what is deterministic: with the parsers
on, greedy replies split into reasoning_content + content that add up to the same request's text
on a server without them (streamed and non-streamed alike); tools and tool_choice are accepted,
rendered and validated; malformed tool calls in the history are 400s, never 500s. Parsing of
real DeepSeek replies (markers, fences, split tags) is covered by the Rust tests over fixtures
(crates/mla-server/tests/output_parsers.rs, http_parsers.rs).
"""

import json

import openai
import pytest

from server import Server, run_cli

MSG = [{"role": "user", "content": "What's the weather in Paris?"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL_HISTORY = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
]


@pytest.fixture(scope="module")
def parsed():
    server = Server(
        "--max-model-len", "1024",
        "--reasoning-parser", "deepseek-r1",
        "--tool-call-parser", "deepseek_v3",
        "--enable-auto-tool-choice",
    )
    yield server.client()
    server.stop()


def joined(message) -> str:
    reasoning = getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content") or ""
    return reasoning + (message.content or "")


def streamed(chunks) -> tuple[str, str, list]:
    reasoning, content, finish = "", "", []
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        assert not d.tool_calls, "random text holds no tool-call markers"
        if c.choices[0].finish_reason:
            finish.append(c.choices[0].finish_reason)
    return reasoning, content, finish


def test_reasoning_plus_content_is_the_unparsed_text(client, parsed):
    plain = client.chat.completions.create(model="demo", messages=MSG, max_tokens=24, **GREEDY)
    r = parsed.chat.completions.create(model="demo", messages=MSG, max_tokens=24, **GREEDY)
    assert "reasoning_content" in r.choices[0].message.model_extra
    assert joined(r.choices[0].message) == plain.choices[0].message.content
    assert r.usage.completion_tokens == plain.usage.completion_tokens == 24
    assert r.choices[0].finish_reason == "length"


def test_streamed_split_equals_non_streamed(parsed):
    full = parsed.chat.completions.create(model="demo", messages=MSG, max_tokens=24, **GREEDY).choices[0].message
    stream = parsed.chat.completions.create(
        model="demo", messages=MSG, max_tokens=24, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    reasoning, content, finish = streamed(chunks)
    assert reasoning == (full.model_extra.get("reasoning_content") or "")
    assert content == (full.content or "")
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 24


def test_tools_with_auto_and_none_render_and_parse(client, parsed):
    plain = client.chat.completions.create(model="demo", messages=MSG, max_tokens=16, **GREEDY)
    for choice in ("auto", "none", None):
        extra = {} if choice is None else {"tool_choice": choice}
        r = parsed.chat.completions.create(model="demo", messages=MSG, tools=TOOLS, max_tokens=16, **extra, **GREEDY)
        # The published V3 template does not print tool definitions: same prompt, same text.
        assert joined(r.choices[0].message) == plain.choices[0].message.content, choice
        assert not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "length"
    stream = parsed.chat.completions.create(
        model="demo", messages=MSG, tools=TOOLS, tool_choice="auto", max_tokens=16, stream=True, **GREEDY
    )
    reasoning, content, finish = streamed(stream)
    assert reasoning + content == plain.choices[0].message.content and finish == ["length"]


def test_tool_call_history_with_object_arguments(parsed):
    history = [dict(m) for m in CALL_HISTORY]
    string_form = parsed.chat.completions.create(model="demo", messages=history, tools=TOOLS, max_tokens=8, **GREEDY)
    history[1] = {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    object_form = parsed.chat.completions.create(model="demo", messages=history, tools=TOOLS, max_tokens=8, **GREEDY)
    # Same prompt either way: the object is serialized as the SDK serializes the string form.
    assert object_form.usage.prompt_tokens == string_form.usage.prompt_tokens
    assert joined(object_form.choices[0].message) == joined(string_form.choices[0].message)


def test_auto_without_the_flags_is_a_400(client):
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="demo", messages=MSG, tools=TOOLS, max_tokens=4, **extra)
        assert "--enable-auto-tool-choice" in e.value.message
    # "none" needs no parser: the tools are rendered, nothing is parsed.
    r = client.chat.completions.create(model="demo", messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content is not None and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "tool_choice, needle",
    [
        ({"type": "function", "function": {"name": "get_time"}}, "not among the request's tools"),
        ("sometimes", "tool_choice"),
    ],
)
def test_tool_choice_refusals(parsed, tool_choice, needle):
    with pytest.raises(openai.BadRequestError) as e:
        parsed.chat.completions.create(model="demo", messages=MSG, tools=TOOLS, tool_choice=tool_choice, max_tokens=4)
    assert needle in e.value.message


@pytest.mark.parametrize(
    "tools, param",
    [
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        ([{"type": "code_interpreter"}], "tools[0].type"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools[0].function.parameters"),
        ([{"type": "function"}], "tools[0].function"),
    ],
)
def test_malformed_tools_are_400_naming_the_field(parsed, tools, param):
    with pytest.raises(openai.BadRequestError) as e:
        parsed.chat.completions.create(model="demo", messages=MSG, tools=tools, max_tokens=4)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize(
    "call, param",
    [
        ({"id": "c", "type": "function"}, "messages[1].tool_calls[0].function"),
        ({"id": "c", "type": "function", "function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
        ({"id": "c", "type": "function", "function": {"name": "f"}}, "messages[1].tool_calls[0].function.arguments"),
        ({"id": "c", "type": "function", "function": {"name": "f", "arguments": [1]}}, "messages[1].tool_calls[0].function.arguments"),
        ("not a call", "messages[1].tool_calls[0]"),
    ],
)
def test_malformed_tool_calls_are_400_not_500(client, call, param):
    messages = [MSG[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=messages, max_tokens=4)
    assert e.value.body["param"] == param, e.value.body


def test_legacy_functions_are_refused_clearly(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=MSG, functions=[{"name": "f", "parameters": {}}], max_tokens=4)
    assert "send tools instead" in e.value.message


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--reasoning-parser", "qwen3"], "known: deepseek_r1"),
        (["--tool-call-parser", "hermes"], "known: deepseek_v3, deepseek_v31"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    ],
)
def test_bad_parser_flags_fail_at_startup(args, needle):
    r = run_cli(*args, "--port", "1")
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr


def test_flags_are_in_help():
    r = run_cli("--help")
    assert r.returncode == 0
    for flag in ["--reasoning-parser", "--tool-call-parser", "--enable-auto-tool-choice"]:
        assert flag in r.stdout, flag


# Random weights would write an unbounded string forever (a valid reply cut by max_tokens); a
# bounded schema makes every finished call checkable.
BOUNDED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0, "seed": 4}])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_is_a_valid_call_even_from_random_weights(client, tool_choice, sampling):
    # No parser flags: "required" and named choices constrain decoding to DeepSeek-V3's call
    # format with arguments valid against the tool's schema, and parse it with the V3 parser.
    r = client.chat.completions.create(
        model="demo", messages=MSG, tools=BOUNDED_TOOLS, tool_choice=tool_choice, max_tokens=300, **sampling
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and {c.function.name for c in calls} <= {"get_weather", "get_time"}
    if isinstance(tool_choice, dict):
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
    for c in calls:
        args = json.loads(c.function.arguments)
        if c.function.name == "get_weather":
            assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 12, args
        else:
            assert args == {}, args


def test_a_forced_tool_call_streams_as_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model="demo", messages=MSG, tools=BOUNDED_TOOLS[:1], tool_choice="required", max_tokens=300, stream=True,
        temperature=0,
    )
    names, args, finish = [], {}, []
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                if d.function and d.function.name:
                    names.append(d.function.name)
                args[d.index] = args.get(d.index, "") + ((d.function and d.function.arguments) or "")
            if ch.finish_reason:
                finish.append(ch.finish_reason)
    assert finish == ["tool_calls"] and names and set(names) == {"get_weather"}
    assert all(isinstance(json.loads(a)["city"], str) for a in args.values())


def test_a_forced_tool_call_with_response_format_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="demo", messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=8,
            response_format={"type": "json_object"},
        )
    assert "tool_choice" in e.value.message
