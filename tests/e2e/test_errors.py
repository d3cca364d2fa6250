"""Error answers: status codes and OpenAI error bodies."""

import openai
import pytest
import requests

from server import Server

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"extra_body": {"top_k": -3}}, "top_k"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"extra_body": {"stop_token_ids": [100000]}}, "stop_token_ids"),
    ],
)
def test_invalid_values_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=MSG, **kwargs)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


def test_prompt_too_long_states_limit_and_length(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt=[5] * 1100, max_tokens=4)
    msg = e.value.body["message"]
    assert "1024" in msg and "1100" in msg and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=MSG, max_tokens=5000)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_malformed_json_and_bad_bodies_are_400(demo):
    for body in ["{", "[]", "null", '{"messages": 5}', '{"prompt": {"a": 1}}']:
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = requests.post(demo.base + path, data=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, body, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # The server is still alive and well.
    assert requests.get(demo.base + "/health").status_code == 200


def test_oversized_body_is_413(demo):
    body = '{"prompt": "' + "a" * (33 << 20) + '"}'
    try:
        r = requests.post(demo.base + "/v1/completions", data=body, headers={"content-type": "application/json"})
    except requests.ConnectionError:
        pytest.fail("the server closed the connection instead of answering 413")
    assert r.status_code == 413
    assert "limit" in r.json()["error"]["message"]


def test_routes_and_methods(demo):
    r = requests.get(demo.base + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = requests.get(demo.base + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_models_health_metrics(demo, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert requests.get(demo.base + "/health").status_code == 200
    text = requests.get(demo.base + "/metrics").text
    for series in [
        "mla:num_requests_running",
        "mla:num_requests_waiting",
        "mla:kv_cache_usage_perc",
        "mla:prompt_tokens_total",
        "mla:generation_tokens_total",
        "mla:request_success_total",
        "mla:num_preemptions_total",
        "mla:time_to_first_token_seconds_bucket",
        "mla:inter_token_latency_seconds_bucket",
        "mla:e2e_request_latency_seconds_bucket",
        "mla:request_queue_time_seconds_bucket",
    ]:
        assert series in text, series


def test_api_key():
    server = Server("--api-key", "sk-e2e", "--max-model-len", "256")
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            server.client(api_key="wrong").models.list()
        assert e.value.status_code == 401
        r = requests.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401
        ok = server.client(api_key="sk-e2e").completions.create(model="demo", prompt="x", max_tokens=1)
        assert ok.usage.completion_tokens == 1
        assert requests.get(server.base + "/health").status_code == 200
        assert requests.get(server.base + "/metrics").status_code == 200
    finally:
        server.stop()
