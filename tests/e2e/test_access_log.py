"""The access log: one line per request on the server's log, with status, tokens and latency,
for finished, failed and abandoned requests alike; probes and scrapes kept out by default."""

import time

import openai
import pytest
import requests

from server import Server

CHAT = '"POST /v1/chat/completions"'


def access_lines(server, level="INFO"):
    return [line for line in server.log_text().splitlines() if f" {level} access: " in line]


def wait_for_line(server, needle, timeout=30.0):
    """The access line containing `needle`; lines are written when the response ends, which for
    an abandoned stream is when the server notices the client has gone."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [line for line in access_lines(server) if needle in line]
        if found:
            assert len(found) == 1, found
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no access line with {needle!r}:\n" + "\n".join(access_lines(server)))


def fields(line):
    return dict(word.split("=", 1) for word in line.split(" access: ", 1)[1].split() if "=" in word)


@pytest.fixture(scope="module")
def server():
    # Long enough a context that the abandoned requests are still generating when they are left.
    server = Server("--max-model-len", "4096")
    yield server
    server.stop()


def test_a_finished_request(server):
    client = server.client()
    reply = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=5, extra_body={"ignore_eos": True}
    )
    line = wait_for_line(server, f"request_id={reply.id}")
    assert " 127.0.0.1:" in line and f"{CHAT} 200 " in line, line
    f = fields(line)
    assert f["prompt_tokens"] == str(reply.usage.prompt_tokens)
    assert (f["completion_tokens"], f["cached_tokens"], f["finish"], f["stream"]) == ("5", "0", "length", "false")
    assert 0 < float(f["ttft_ms"]) <= float(f["latency_ms"])
    assert "aborted" not in f


def test_a_stream_the_client_leaves(server):
    client = server.client()
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4000, stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    stream.close()
    # Its 200 was sent with the first chunk; the line says how it ended.
    line = wait_for_line(server, f"request_id={first.id}")
    assert f"{CHAT} 200 " in line, line
    f = fields(line)
    assert (f["finish"], f["stream"], f["aborted"]) == ("abort", "true", "true")
    assert int(f["completion_tokens"]) < 4000


def test_a_request_left_before_its_response(server):
    with pytest.raises(requests.Timeout):
        requests.post(
            server.base + "/v1/completions",
            json={"prompt": [0, 7], "max_tokens": 4000, "ignore_eos": True},
            timeout=0.2,
        )
    # No response existed: nothing was sent, logged as nginx logs it.
    line = wait_for_line(server, '"POST /v1/completions" 499 ')
    f = fields(line)
    assert (f["finish"], f["stream"], f["aborted"]) == ("abort", "false", "true")
    assert f["request_id"].startswith("cmpl-")


def test_errors_get_a_line(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], temperature=-1)
    line = wait_for_line(server, f"{CHAT} 400 ")
    assert "prompt_tokens" not in line and "aborted" not in line, line
    assert requests.get(server.base + "/no/such/path", timeout=10).status_code == 404
    wait_for_line(server, '"GET /no/such/path" 404 ')


def test_probes_and_scrapes_stay_out_by_default(server):
    requests.get(server.base + "/metrics", timeout=10)
    server.client().models.list()
    wait_for_line(server, '"GET /v1/models" 200 ')
    # The harness polled /health until the server was up.
    assert not [line for line in access_lines(server) if '"GET /health"' in line or '"GET /metrics"' in line]


def test_the_flags_that_quiet_it():
    quiet = Server("--disable-uvicorn-access-log", "--log-level", "debug")
    every = Server("--disable-access-log-for-endpoints", "")
    try:
        for s in (quiet, every):
            s.client().models.list()
        wait_for_line(every, '"GET /v1/models" 200 ')
        assert [line for line in access_lines(every) if '"GET /health" 200 ' in line]
        deadline = time.time() + 10
        while not access_lines(quiet, "DEBUG") and time.time() < deadline:
            time.sleep(0.05)
        assert access_lines(quiet) == [] and access_lines(quiet, "DEBUG"), "the lines go to debug level"
    finally:
        quiet.stop()
        every.stop()
