#!/usr/bin/env python3
"""Record HF transformers' chat-template and tokenizer outputs as fixtures for mla-server's tests.

The Rust side must reproduce these byte for byte, so they are the independent reference:
  tests/fixtures/templates/deepseek-v2-chat.json, deepseek-v3.json
      apply_chat_template(..., tokenize=False) and (..., tokenize=True) of the published templates
      (copied next to this file's outputs) for a set of conversations, on the demo tokenizer.
  tests/fixtures/templates/probes.json
      small templates of our own that exercise one template feature each (tojson, Python string
      methods, namespace, loop controls, whitespace control, printing of Python values, errors).
  tests/fixtures/templates/demo_tokenizer.json
      tokenizer(text) / decode(ids) of the demo tokenizer, with and without special tokens.

Messages are stored in OpenAI request form. Content given as a list of text parts is flattened
the way vLLM does for string-content templates ("\n".join of the texts) before HF sees it,
because HF itself would hand the list to the template unchanged.

Usage: python3 scripts/record_template_fixtures.py  (needs transformers, jinja2, tokenizers)
"""

import copy
import json
from pathlib import Path

import jinja2
import transformers
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests/fixtures/templates"
DEMO = REPO / "assets/demo"

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city <with> 'markup' & \"quotes\"",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "Ville / 城市"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
}


def tool_call(call_id: str, name: str, arguments: dict) -> dict:
    # OpenAI form: arguments is a JSON *string*, which is what DeepSeek's template concatenates.
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def common_cases() -> list[dict]:
    """Conversations every chat template must render."""
    return [
        {"name": "user_only_generation_prompt", "add_generation_prompt": True,
         "messages": [{"role": "user", "content": "Hello!"}]},
        {"name": "user_only_no_generation_prompt", "add_generation_prompt": False,
         "messages": [{"role": "user", "content": "Hello!"}]},
        {"name": "system_and_user", "add_generation_prompt": True,
         "messages": [SYSTEM, {"role": "user", "content": "What is 2+2?"}]},
        {"name": "multi_turn", "add_generation_prompt": True,
         "messages": [SYSTEM, {"role": "user", "content": "What is 2+2?"},
                      {"role": "assistant", "content": "2 + 2 = 4."},
                      {"role": "user", "content": "And times 3?"}]},
        {"name": "ends_with_assistant", "add_generation_prompt": False,
         "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]},
        {"name": "unicode", "add_generation_prompt": True,
         "messages": [{"role": "user", "content": "你好，世界！😀 Ünïcödé — “quotes” \\ back\nnew line\ttab"},
                      {"role": "assistant", "content": "こんにちは 🚀 e\u0301 👩‍👩‍👧"},
                      {"role": "user", "content": "مرحبا بالعالم"}]},
        {"name": "content_text_parts", "add_generation_prompt": True,
         "messages": [{"role": "user", "content": [{"type": "text", "text": "Part one."},
                                                   {"type": "text", "text": "Part two."}]}]},
        {"name": "empty_content", "add_generation_prompt": True,
         "messages": [{"role": "user", "content": ""}]},
        {"name": "whitespace_content", "add_generation_prompt": True,
         "messages": [{"role": "user", "content": "  padded  \n\n"}]},
        {"name": "template_syntax_in_content", "add_generation_prompt": True,
         "messages": [{"role": "user", "content": "{{ bos_token }} {% if x %}raw{% endif %} {# c #}"}]},
        {"name": "continue_final_message", "add_generation_prompt": False, "continue_final_message": True,
         "messages": [{"role": "user", "content": "Write a haiku."},
                      {"role": "assistant", "content": "Autumn moon rises"}]},
        {"name": "continue_final_message_trailing_space", "add_generation_prompt": False,
         "continue_final_message": True,
         "messages": [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one two "}]},
    ]


def v3_cases() -> list[dict]:
    """Conversations only DeepSeek-V3's template gives meaning to (tool calls and results)."""
    weather = tool_call("call_1", "get_weather", {"city": "Paris", "unit": "celsius"})
    time_call = tool_call("call_2", "get_time", {"zone": "Europe/Paris"})
    return [
        {"name": "two_system_messages", "add_generation_prompt": True,
         "messages": [SYSTEM, {"role": "system", "content": "Answer in French."},
                      {"role": "user", "content": "Hi"}]},
        {"name": "tool_call_single", "add_generation_prompt": True, "tools": [WEATHER_TOOL],
         "messages": [SYSTEM, {"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": None, "tool_calls": [weather]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}]},
        {"name": "tool_call_then_answer", "add_generation_prompt": True, "tools": [WEATHER_TOOL],
         "messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": None, "tool_calls": [weather]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "21 °C, sunny ☀"},
                      {"role": "assistant", "content": "It is 21 °C and sunny."},
                      {"role": "user", "content": "Thanks!"}]},
        {"name": "two_tool_calls_two_results", "add_generation_prompt": True,
         "messages": [{"role": "user", "content": "Weather and time in Paris?"},
                      {"role": "assistant", "content": None, "tool_calls": [weather, time_call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                      {"role": "tool", "tool_call_id": "call_2", "content": "12:30"}]},
        {"name": "tool_calls_in_two_turns", "add_generation_prompt": True,
         "messages": [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": None, "tool_calls": [weather]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                      {"role": "assistant", "content": "Sunny."},
                      {"role": "user", "content": "And the time?"},
                      {"role": "assistant", "content": None, "tool_calls": [time_call]},
                      {"role": "tool", "tool_call_id": "call_2", "content": "12:30"}]},
        {"name": "assistant_null_content_without_tool_calls", "add_generation_prompt": True,
         "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                      {"role": "user", "content": "Hello?"}]},
        {"name": "tools_given_no_call", "add_generation_prompt": True, "tools": [WEATHER_TOOL],
         "messages": [{"role": "user", "content": "Just chat."}]},
    ]


def v2_cases() -> list[dict]:
    return [
        # 'Assistant: ' + None is a TypeError in Python; the Rust side must fail too.
        {"name": "assistant_null_content_is_an_error", "add_generation_prompt": True,
         "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
        # A missing key is jinja2's Undefined; concatenating it raises UndefinedError.
        {"name": "missing_content_is_an_error", "add_generation_prompt": True,
         "messages": [{"role": "user"}]},
        # Roles the template does not know are skipped, not errors.
        {"name": "tool_role_is_ignored", "add_generation_prompt": True,
         "messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}]},
    ]


def probe_cases() -> list[dict]:
    """One small template per feature; conversation kept trivial unless the feature needs more."""
    user = [{"role": "user", "content": "  Hello, World  "}]
    three = [SYSTEM, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "tool", "content": "c"}, {"role": "user", "content": "d"}]
    payload = [{"type": "function", "function": {
        "name": "f", "html": "<b>&'x'</b>", "unicode": "é中😀", "ctrl": "a\nb\t\u0001\u007f\u2028",
        "ints": [0, -3, 12345678901234], "floats": [0.5, 1.0, -2.25, 1e-07, 1e+20, 123456789.125, 0.1],
        "flags": [True, False, None], "empty": {}, "nested": {"z": 1, "a": [[]]}}}]
    return [
        {"name": "tojson_default", "messages": user, "tools": payload, "template": "{{ tools | tojson }}"},
        {"name": "tojson_indent", "messages": user, "tools": payload, "template": "{{ tools | tojson(indent=2) }}"},
        {"name": "tojson_indent_string", "messages": user, "tools": payload,
         "template": "{{ tools[0].function.nested | tojson(indent='\\t') }}"},
        {"name": "tojson_sort_keys_separators", "messages": user, "tools": payload,
         "template": "{{ tools | tojson(sort_keys=true, separators=(',', ':')) }}"},
        {"name": "tojson_ensure_ascii", "messages": user, "tools": payload,
         "template": "{{ tools[0].function | tojson(ensure_ascii=true) }}"},
        {"name": "tojson_message", "messages": three, "template": "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"},
        {"name": "string_methods", "messages": user,
         "template": "{% set c = messages[0].content %}[{{ c.strip() }}][{{ c.lstrip() }}][{{ c.rstrip() }}]"
                     "[{{ c.upper() }}][{{ c.lower() }}][{{ c.strip().title() }}][{{ c.replace('l', 'L') }}]"
                     "[{{ c.strip().startswith('Hello') }}][{{ c.endswith('  ') }}][{{ c.split(',') | join('|') }}]"
                     "[{{ c.split() | join('|') }}][{{ c.find('World') }}][{{ c.strip('H ') }}]"
                     "[{{ c.strip().capitalize() }}][{{ c.count('l') }}]"},
        {"name": "dict_methods", "messages": three,
         "template": "{% for m in messages %}{{ m.get('role') }}={{ m.get('name', 'anon') }};"
                     "{% for k, v in m.items() %}{{ k }}:{{ v }},{% endfor %}"
                     "{{ m.keys() | list | length }}\n{% endfor %}"},
        {"name": "namespace_and_loop_controls", "messages": three,
         "template": "{% set ns = namespace(n=0, seen='') %}{% for m in messages %}"
                     "{% if loop.index0 == 1 %}{% continue %}{% endif %}"
                     "{% if m.role == 'tool' %}{% break %}{% endif %}"
                     "{% set ns.n = ns.n + 1 %}{% set ns.seen = ns.seen + m.role[0] %}"
                     "{{ loop.index }}:{{ m.role }}{% if not loop.last %},{% endif %}{% endfor %}"
                     " n={{ ns.n }} seen={{ ns.seen }}"},
        {"name": "whitespace_control", "messages": three,
         "template": "{% for m in messages %}\n    {% if m.role == 'user' %}\n        U: {{ m.content }}\n"
                     "    {% elif m.role == 'assistant' -%}\n        A: {{ m.content }}\n    {%- endif %}\n"
                     "{% endfor %}\n  {{- ' end' }}  \n{%+ if true %}kept{% endif %}\n"},
        {"name": "printing_python_values", "messages": user, "tools": payload,
         "template": "{{ none }}|{{ true }}|{{ false }}|{{ 1.5 }}|{{ 2.0 }}|{{ 10 / 4 }}|{{ 7 // 2 }}|{{ 1e20 }}"
                     "|{{ [1, 'a', none, true] }}|{{ {'k': 'v', 'n': 1} }}|{{ messages[0].get('missing') }}"
                     "|{{ messages[0].missing }}|{{ tools[0].function.floats }}"},
        {"name": "tests_and_filters", "messages": three,
         "template": "{{ messages | length }} {{ messages[1:] | map(attribute='role') | join(',') }} "
                     "{{ messages[-1].content }} {{ messages[0] is mapping }} {{ messages[0].content is string }} "
                     "{{ messages[0].nope is defined }} {{ messages[0].nope is none }} {{ none is none }} "
                     "{{ '=' * 3 }} {{ 'a' in 'cat' }} {{ messages[0].content | trim | length }} "
                     "{{ messages[0].nope | default('dflt') }} {{ messages | selectattr('role', 'equalto', 'user') | list | length }} "
                     "{{ (messages | first).role }} {{ (messages | last).role }} {{ 'x' ~ 1 ~ 'y' }}"},
        {"name": "special_token_variables", "messages": user, "add_generation_prompt": True,
         "template": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ add_generation_prompt }}"
                     "|{{ tools is none }}|{{ documents is none }}|{{ unk_token is defined }}"},
        {"name": "raise_exception", "messages": user,
         "template": "{% if messages[0].role != 'system' %}{{ raise_exception('Conversation roles must start with system, got ' + messages[0].role) }}{% endif %}ok"},
        {"name": "undefined_concatenation_is_an_error", "messages": user,
         "template": "{{ 'x' + messages[0].nope }}"},
        {"name": "undefined_iteration_is_empty", "messages": user,
         "template": "[{% for t in messages[0].tool_calls %}{{ t }}{% endfor %}]"},
    ]


def flatten_like_vllm(messages: list[dict]) -> list[dict]:
    out = copy.deepcopy(messages)
    for m in out:
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(part["text"] for part in m["content"])
    return out


def render(tok, template: str, case: dict, tokenize: bool):
    return tok.apply_chat_template(
        flatten_like_vllm(case["messages"]),
        tools=case.get("tools"),
        chat_template=template,
        add_generation_prompt=case.get("add_generation_prompt", False),
        continue_final_message=case.get("continue_final_message", False),
        tokenize=tokenize,
        return_dict=False,
    )


def record(tok, template: str, case: dict, with_ids: bool) -> dict:
    out = dict(case)
    try:
        out["rendered"] = render(tok, template, case, tokenize=False)
        if with_ids:
            out["token_ids"] = render(tok, template, case, tokenize=True)
    except Exception as e:  # the fixture records that HF refuses, and why
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def versions() -> dict:
    return {"transformers_version": transformers.__version__, "jinja2_version": jinja2.__version__}


def tokenizer_cases(tok) -> dict:
    texts = ["Hello world!", "", " leading space", "trailing space ", "你好，世界 😀 café",
             "<｜User｜>Hi<｜Assistant｜>", "<｜begin▁of▁sentence｜>already has BOS",
             "tool: <｜tool▁call▁begin｜>function<｜tool▁sep｜>f<｜tool▁call▁end｜>",
             "Numbers 1234567 and 3.14159", "line\nbreaks\r\n\ttabs"]
    encodings = [{"text": t, "with_special_tokens": tok(t)["input_ids"],
                  "without_special_tokens": tok(t, add_special_tokens=False)["input_ids"]} for t in texts]
    id_lists = [[0, 501, 42, 458, 81, 502, 1], [503, 505, 511, 506, 504], [2, 1, 0],
                [163, 124], [163, 124, 257], [331, 249], [331, 249, 225, 1], list(range(256, 300))]
    decodings = [{"ids": ids, "skip_special_tokens": tok.decode(ids, skip_special_tokens=True),
                  "keep_special_tokens": tok.decode(ids, skip_special_tokens=False)} for ids in id_lists]
    return {**versions(), "tokenizer": "assets/demo", "vocab_size": len(tok),
            "bos": [tok.bos_token, tok.bos_token_id], "eos": [tok.eos_token, tok.eos_token_id],
            "special_token_ids": sorted(set(tok.all_special_ids)),
            "encodings": encodings, "decodings": decodings}


def write(name: str, value: dict) -> None:
    (OUT / name).write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    tok = AutoTokenizer.from_pretrained(DEMO)
    for stem, cases in [("deepseek-v2-chat", common_cases() + v2_cases()),
                        ("deepseek-v3", common_cases() + v3_cases())]:
        template = (OUT / f"{stem}.jinja").read_text(encoding="utf-8")
        write(f"{stem}.json", {**versions(), "template": f"{stem}.jinja", "tokenizer": "assets/demo",
                               "cases": [record(tok, template, c, with_ids=True) for c in cases]})
    probes = [record(tok, c["template"], c, with_ids=False) for c in probe_cases()]
    write("probes.json", {**versions(), "tokenizer": "assets/demo", "cases": probes})
    write("demo_tokenizer.json", tokenizer_cases(tok))
    print(f"wrote fixtures to {OUT}")


if __name__ == "__main__":
    main()
