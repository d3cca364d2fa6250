"""CORS (--allowed-origins and its companions, vLLM's flags), over real HTTP. Off by default."""

import json

import requests

from server import Server, run_cli

ALLOWED = "https://app.example"


def preflight(server, origin, path="/v1/chat/completions"):
    return requests.options(
        server.base + path,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
        timeout=10,
    )


def cors_headers(response):
    return {k.lower(): v for k, v in response.headers.items() if k.lower().startswith("access-control-")}


def test_no_cors_headers_without_the_flag(demo):
    assert cors_headers(preflight(demo, ALLOWED)) == {}
    assert cors_headers(requests.get(demo.base + "/v1/models", headers={"Origin": ALLOWED}, timeout=10)) == {}


def test_an_allowed_origin_and_another_one():
    server = Server("--allowed-origins", json.dumps([ALLOWED]), "--api-key", "k")
    try:
        r = preflight(server, ALLOWED)
        h = cors_headers(r)
        assert r.status_code == 200, r.text
        assert h["access-control-allow-origin"] == ALLOWED
        assert h["access-control-allow-methods"] == "*" and h["access-control-allow-headers"] == "*"
        assert h["access-control-max-age"] == "600"
        chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = requests.post(server.base + "/v1/chat/completions", json=chat, timeout=60,
                          headers={"Origin": ALLOWED, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED
        # The key is still required, and the page can read why it was refused.
        r = requests.post(server.base + "/v1/chat/completions", json=chat, headers={"Origin": ALLOWED}, timeout=10)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ALLOWED

        other = "https://other.example"
        assert "access-control-allow-origin" not in cors_headers(preflight(server, other))
        r = requests.get(server.base + "/v1/models", headers={"Origin": other, "Authorization": "Bearer k"}, timeout=10)
        assert r.status_code == 200 and "access-control-allow-origin" not in cors_headers(r)
        assert '"OPTIONS /v1/chat/completions" 200 ' in server.log_text(), "preflights are in the access log"
    finally:
        server.stop()


def test_credentials_with_any_origin_echo_the_request():
    server = Server(
        "--allowed-origins", '["*"]', "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["Authorization"]',
        "--allow-credentials",
    )
    try:
        origin = "https://any.example"
        h = cors_headers(preflight(server, origin))
        # Browsers refuse `*` together with credentials: the origin itself comes back.
        assert h["access-control-allow-origin"] == origin and h["access-control-allow-credentials"] == "true"
        assert "POST" in h["access-control-allow-methods"]
        # Content-Type is always allowed, so a page naming only Authorization can still post JSON.
        allowed = {v.strip().lower() for v in h["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type"} <= allowed
    finally:
        server.stop()


def test_mistakes_fail_at_start():
    for args, needle in [
        (["--allow-credentials"], "has no effect without --allowed-origins"),
        (["--allowed-origins", ALLOWED], "JSON list of strings"),
        (["--allowed-origins", json.dumps([ALLOWED + "/"])], "is not an origin"),
    ]:
        r = run_cli(*args)
        assert r.returncode != 0 and needle in r.stderr, (args, r.stderr)
