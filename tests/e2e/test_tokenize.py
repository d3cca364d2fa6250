"""vLLM's /tokenize, /detokenize and /version through the real binary: the ids /tokenize gives
for a prompt are the ones a completion is charged for (usage.prompt_tokens), for messages the
ones a chat completion is charged for, and /detokenize inverts them."""

import requests

from server import Server


def post(demo, path, body, **kw):
    return requests.post(demo.base + path, json=body, timeout=30, **kw)


def test_tokenize_matches_what_requests_are_charged(demo, client):
    text = "The quick brown fox"
    r = post(demo, "/tokenize", {"model": "demo", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["max_model_len"] == 1024
    charged = client.completions.create(model="demo", prompt=text, max_tokens=1).usage.prompt_tokens
    assert body["count"] == charged
    # Without BOS: one id fewer (the demo tokenizer adds one), as vLLM's add_special_tokens=false.
    bare = post(demo, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["count"] == body["count"] - 1 and bare["token_strs"] is None

    messages = [{"role": "user", "content": "hi there"}]
    chat = post(demo, "/tokenize", {"model": "demo", "messages": messages}).json()
    charged = client.chat.completions.create(model="demo", messages=messages, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == charged
    no_gen = post(demo, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["count"] < chat["count"]

    back = post(demo, "/detokenize", {"model": "demo", "tokens": bare["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_takes_the_chat_tools(demo, client):
    messages = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = post(demo, "/tokenize", {"messages": messages, "tools": tools})
    assert r.status_code == 200, r.text
    chat = client.chat.completions.create(
        model="demo", messages=messages, tools=tools, tool_choice="none", max_tokens=1
    )
    assert r.json()["count"] == chat.usage.prompt_tokens


def test_bad_tokenize_requests_are_400_naming_the_field(demo):
    cases = [
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ({}, "prompt"),
        ({"messages": [{"role": "user", "content": "b"}], "chat_template": "{{x}}"}, "chat_template"),
        ({"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True}, "add_special_tokens"),
        ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
        ({"messages": [{"role": "user", "content": "b"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ]
    for body, param in cases:
        r = post(demo, "/tokenize", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = post(demo, "/detokenize", {"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]", r.text
    r = post(demo, "/tokenize", {"model": "other", "prompt": "a"})
    assert r.status_code == 404, r.text


def test_version_and_api_key():
    server = Server("--api-key", "sk-test")
    try:
        assert requests.get(server.base + "/version", timeout=10).json()["version"]
        assert post(server, "/tokenize", {"prompt": "a"}).status_code == 401
        ok = post(server, "/tokenize", {"prompt": "a"}, headers={"Authorization": "Bearer sk-test"})
        assert ok.status_code == 200, ok.text
    finally:
        server.stop()
