"""Hostile and careless clients against the real binary, with normal traffic alongside: every
hostile request gets the answer it should, and normal requests' median latency stays within a
factor of the unloaded run (the figures themselves are recorded by scripts/hostile_probe.py)."""

import asyncio

import pytest

import hostile
from server import Server

# Normal traffic's median under hostile load may be at most this times the unloaded median, plus
# a slack for a 2-core CI machine where the test client itself competes for the CPU.
FACTOR = 3.0
SLACK_MS = 100.0
KEEP_ALIVE_S = 1.0
BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def guarded():
    server = Server("--max-model-len", "1024", "--timeout-keep-alive", str(KEEP_ALIVE_S),
                    "--body-read-timeout", str(BODY_TIMEOUT_S))
    yield server
    server.stop()


def run(coro):
    return asyncio.run(coro)


def assert_unaffected(baseline: dict, loaded: dict, what: str):
    assert not loaded["failed"], f"{what}: normal requests failed: {loaded['failed']}"
    assert not loaded["health_not_200"], f"{what}: /health answered {loaded['health_not_200']}"
    bound = FACTOR * baseline["p50_ms"] + SLACK_MS
    assert loaded["p50_ms"] <= bound, f"{what}: median {loaded['p50_ms']:.0f} ms > {bound:.0f} ms"


def test_hostile_requests_are_refused_and_leave_normal_traffic_alone(guarded):
    base, model = guarded.base, "demo"
    baseline, _ = run(hostile.measure_during(base, model, None))
    assert baseline["requests"] > 0 and not baseline["failed"]

    loaded, stops = run(hostile.measure_during(base, model, lambda: hostile.many_long_stop_strings(base, model)))
    assert [s["status"] for s in stops["streams"]] == [200, 200]
    assert stops["over_limit"]["status"] == 400
    assert_unaffected(baseline, loaded, "64 stop strings of 1 KB")

    loaded, big = run(hostile.measure_during(base, model, lambda: hostile.huge_prompts(base, model)))
    assert big["text_over_body_limit"]["status"] == 413
    assert big["ids_over_body_limit"]["status"] == 413
    for key in ("text_under_body_limit", "chat_under_body_limit", "ids_under_body_limit"):
        assert (big[key]["status"], big[key]["code"]) == (400, "context_length_exceeded"), (key, big[key])
    assert_unaffected(baseline, loaded, "31 MB prompts")

    loaded, shapes = run(hostile.measure_during(base, model, lambda: hostile.request_shapes(base, model)))
    assert {k: v["status"] for k, v in shapes.items()} == {
        "prompts_times_n": 400, "prompts_2000": 400, "malformed_tool_calls": 400, "form_post": 415}
    assert_unaffected(baseline, loaded, "requests that cannot be served")


def test_idle_and_slow_connections_are_closed_and_health_keeps_answering(guarded):
    base, model = guarded.base, "demo"
    baseline, _ = run(hostile.measure_during(base, model, None))
    probe = lambda: hostile.idle_and_slow_connections(  # noqa: E731
        "127.0.0.1", guarded.port, idle=1100, keep_alive=KEEP_ALIVE_S, body_timeout=BODY_TIMEOUT_S)
    loaded, conns = run(hostile.measure_during(base, model, probe))
    assert conns["idle_opened"] == 1100
    assert conns["idle_closed_by_server"] == 1100
    assert conns["slow_head_closed"]
    assert conns["slow_body_status"].startswith("HTTP/1.1 408"), conns
    assert conns["slow_body_closed"]
    assert_unaffected(baseline, loaded, "1100 idle connections and slow clients")


def test_connections_over_the_limit_get_503_with_retry_after():
    server = Server("--max-connections", "16")
    try:
        got = run(hostile.over_the_connection_limit("127.0.0.1", server.port, 16))
        assert got["status_line"].startswith("http/1.1 503"), got
        assert got["retry_after"] and got["json_body"], got
        # The held connections are gone: the server answers again.
        assert server.client().models.list().data[0].id == "demo"
    finally:
        server.stop()
