"""Hostile and careless clients against the real binary, with normal traffic alongside: every
hostile request gets the answer it should, connections that idle or trickle are closed within
deadlines derived from the server's flags, and normal requests' median latency stays within a
factor of the unloaded run (the figures themselves are recorded by scripts/hostile_probe.py).

The server has no separate --header-read-timeout: --timeout-keep-alive bounds a request head
from the moment a connection can send one (opening, or the previous response), so it closes
idle keep-alive connections and slow-header ones alike (crates/mla-server/src/listener.rs).
"""

import asyncio
import statistics

import pytest

import hostile
from server import Server

KEEP_ALIVE_S = 1.0
BODY_TIMEOUT_S = 2.0
# A connection must be closed by its deadline plus this (the client's event loop, busy with a
# thousand sockets and normal traffic, notices a close late), and not before half its deadline.
CLOSE_SLACK_S = 2.0
IDLE_CONNECTIONS = 1100
MAX_CONNECTIONS = 64


@pytest.fixture(scope="module")
def guarded():
    # No --max-connections: the default (lowered to what the descriptor limit leaves room for)
    # must serve the 1100 idle connections that exhausted descriptors before the fix.
    server = Server("--max-model-len", "1024", "--timeout-keep-alive", str(KEEP_ALIVE_S),
                    "--body-read-timeout", str(BODY_TIMEOUT_S))
    yield server
    server.stop()


def run(coro):
    return asyncio.run(coro)


assert_unaffected = hostile.assert_unaffected


def assert_closed_by_deadline(close_s: float, deadline: float, what: str):
    assert deadline / 2 <= close_s <= deadline + CLOSE_SLACK_S, f"{what}: closed after {close_s} s, deadline {deadline} s"


def test_hostile_requests_are_refused_and_leave_normal_traffic_alone(guarded):
    base, model = guarded.base, "demo"
    baseline, _ = run(hostile.measure_during(base, model, None))
    assert baseline["requests"] > 0 and not baseline["failed"]

    loaded, stops = run(hostile.measure_during(base, model, lambda: hostile.many_long_stop_strings(base, model)))
    assert [s["status"] for s in stops["streams"]] == [200, 200]
    assert stops["over_limit"]["status"] == 400
    assert_unaffected(baseline, loaded, "64 stop strings of 1 KB")

    loaded, big = run(hostile.measure_during(base, model, lambda: hostile.huge_prompts(base, model)))
    assert big["text_over_body_limit"]["status"] == 413, big["text_over_body_limit"]
    assert big["ids_over_body_limit"]["status"] == 413, big["ids_over_body_limit"]
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
        "127.0.0.1", guarded.port, idle=IDLE_CONNECTIONS, keep_alive=KEEP_ALIVE_S, body_timeout=BODY_TIMEOUT_S,
        slack=CLOSE_SLACK_S + 1)
    loaded, conns = run(hostile.measure_during(base, model, probe))
    assert conns["idle_opened"] == IDLE_CONNECTIONS, conns
    assert conns["idle_closed_by_server"] == IDLE_CONNECTIONS, conns
    assert conns["idle_reset"] == 0 and conns["idle_answered"] == [], conns
    first, _, last = conns["idle_close_s"]
    assert_closed_by_deadline(first, KEEP_ALIVE_S, "first idle connection")
    assert_closed_by_deadline(last, KEEP_ALIVE_S, "last idle connection")
    # Header lines kept coming until past the bound: the deadline is for the whole head.
    assert conns["slow_head_closed"], conns
    assert_closed_by_deadline(conns["slow_head_close_s"], KEEP_ALIVE_S, "slow head")
    assert conns["slow_body_status"].startswith("HTTP/1.1 408"), conns
    assert conns["slow_body_closed"], conns
    assert_closed_by_deadline(conns["slow_body_close_s"], BODY_TIMEOUT_S, "slow body")
    assert_unaffected(baseline, loaded, f"{IDLE_CONNECTIONS} idle connections and slow clients")


def test_connections_over_the_limit_get_503_and_held_health_keeps_answering():
    server = Server("--max-connections", str(MAX_CONNECTIONS), "--timeout-keep-alive", str(KEEP_ALIVE_S))
    try:
        got = run(hostile.flood_over_the_cap(server.base, "127.0.0.1", server.port, IDLE_CONNECTIONS,
                                             KEEP_ALIVE_S, slack=CLOSE_SLACK_S + 1))
        assert got["flood_opened"] == IDLE_CONNECTIONS, got
        assert got["not_closed_in_time"] == 0 and got["other_answers"] == [], got
        assert got["refused_503"] > 0, got
        assert got["refused_503_with_retry_after"] == got["refused_503"] == got["refused_503_json_body"], got
        # Refused at once, not held until a deadline.
        assert got["refused_503_close_s"][1] < KEEP_ALIVE_S, got
        # The server never holds more than the cap (its own count, sampled every 100 ms on the
        # /health connection, which is one of them), and the flood filled it.
        assert MAX_CONNECTIONS // 2 <= got["server_open_max"] <= MAX_CONNECTIONS, got
        assert got["held_until_keep_alive"] > 0, got
        assert_closed_by_deadline(got["held_close_s"][2], KEEP_ALIVE_S, "last connection held within the cap")
        assert got["health_on_held_connection"] > 0 and got["health_not_200"] == [], got
        # The flood has gone: a new client is served again.
        assert got["recovered_after_s"] is not None, got
    finally:
        server.stop()


def test_queue_full_503_carries_retry_after():
    # One sequence at a time and one waiting: the third request finds the queue full.
    server = Server("--max-queued-requests", "1", "--max-num-seqs", "1", "--max-model-len", "4096")
    try:
        got = run(hostile.queue_full(server.base, "demo"))
        assert got["third"]["status"] == 503 and got["third"]["code"] == "queue_full", got
        assert got["third"]["retry_after"] == "1", got
        assert [s["status"] for s in got["streams"]] == [200, 200], got
    finally:
        server.stop()


def test_probe_arithmetic():
    # The probe's own arithmetic, against hand-computed values.
    assert hostile.spread([3.0, 1.0, 2.0, 10.0]) == [1.0, statistics.median([1, 2, 3, 10]), 10.0]
    assert hostile.most_at_once([(0, 2), (1, 3), (2, 4), (5, 6)]) == 2
