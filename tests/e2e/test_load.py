"""Concurrency, client aborts and the queue limit."""

import asyncio
import time

import openai
import pytest

from server import Server


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_64_concurrent_streams_complete_with_correct_usage(demo):
    client = demo.async_client()

    async def one(i):
        stream = await client.completions.create(
            model="demo", prompt=[0] + [i + 2] * (i % 7 + 1), max_tokens=8, temperature=0.8, seed=i,
            stream=True, stream_options={"include_usage": True}, logprobs=0, extra_body={"ignore_eos": True},
        )
        tokens, usage, finish = 0, None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                tokens += len(c.logprobs.tokens) if c.logprobs else 0
                finish = c.finish_reason or finish
        return i, tokens, usage, finish

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(64)))

    for i, tokens, usage, finish in asyncio.run(all_of_them()):
        assert finish == "length"
        assert tokens == 8 and usage.completion_tokens == 8
        assert usage.prompt_tokens == i % 7 + 2
    m = demo.metrics()
    assert m["mla:num_requests_running"] == 0


def test_50_cancelled_streams_leave_nothing_running(demo):
    client = demo.async_client()

    async def open_and_cancel(i):
        stream = await client.completions.create(
            model="demo", prompt=[0, i + 1], max_tokens=900, stream=True, extra_body={"ignore_eos": True}
        )
        async for _ in stream:
            break  # one chunk: the request is running
        await stream.close()

    async def all_of_them():
        await asyncio.gather(*(open_and_cancel(i) for i in range(50)))

    before = demo.metrics().get('mla:request_success_total{model_name="demo",finished_reason="abort"}', 0)
    asyncio.run(all_of_them())

    def idle():
        m = demo.metrics()
        return m["mla:num_requests_running"] == 0 and m["mla:num_requests_waiting"] == 0 and m["mla:kv_cache_usage_perc"] == 0

    wait_for(idle, what="zero running requests and zero KV usage")
    after = demo.metrics()['mla:request_success_total{model_name="demo",finished_reason="abort"}']
    assert after - before == 50
    # 900 tokens each were asked for; far fewer were generated before the aborts landed.
    assert demo.metrics()["mla:generation_tokens_total"] < 50 * 900


def test_queue_limit_of_one_answers_503():
    server = Server("--max-queued-requests", "1", "--max-num-seqs", "1", "--max-model-len", "4096")
    try:
        client = server.client()
        long = dict(model="demo", prompt=[0, 1, 2], max_tokens=4000, stream=True, extra_body={"ignore_eos": True})
        running = client.completions.create(**long)
        next(iter(running))  # first token: it is scheduled
        waiting = client.completions.create(**long)  # queued behind it (one sequence at a time)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(**long)
        assert e.value.status_code == 503
        assert e.value.body["code"] == "queue_full"
        running.close()
        waiting.close()
        wait_for(lambda: server.metrics()["mla:num_requests_running"] == 0, what="the aborted requests to end")
    finally:
        server.stop()


def test_dropped_non_streaming_request_is_aborted():
    import requests

    # Its own server, so the request can ask for a generation far longer than the client waits
    # (the shared demo server's 1024-token limit let a fast machine finish 1000 tokens in 0.3 s).
    server = Server("--max-model-len", "4096")
    try:
        key = 'mla:request_success_total{model_name="demo",finished_reason="abort"}'
        before = server.metrics()
        with pytest.raises(requests.Timeout):
            requests.post(
                server.base + "/v1/completions",
                json={"prompt": [0, 9], "max_tokens": 4000, "ignore_eos": True},
                timeout=0.1,
            )
        wait_for(lambda: server.metrics().get(key, 0) == before.get(key, 0) + 1, what="the abort to be counted")
        wait_for(lambda: server.metrics()["mla:num_requests_running"] == 0, what="nothing running")
        generated = server.metrics()["mla:generation_tokens_total"] - before["mla:generation_tokens_total"]
        assert generated < 4000
    finally:
        server.stop()
