"""Hostile and careless clients, as probes against a running mla-serve, with the latency of
normal traffic measured while they run.

Used by tests/e2e/test_hostile_load.py (small, asserts behaviour and a latency factor) and by
scripts/hostile_probe.py (the benchmark that records the figures). Each probe returns a dict
of what the hostile requests got; `measure_during` runs normal traffic alongside any of them.
"""

import asyncio
import json
import resource
import statistics
import time

import httpx

# Normal traffic: short chats, a few in flight, as an interactive user's requests.
NORMAL_IN_FLIGHT = 4
NORMAL_BODY = {"messages": [{"role": "user", "content": "Say something short."}], "max_tokens": 8}


def raise_fd_limit(wanted: int) -> int:
    """This client opens many sockets; lift its own open-file limit as far as allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, wanted), hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


async def normal_traffic(base: str, model: str, stop: asyncio.Event) -> dict:
    """Short chat completions until `stop` is set: latency of each, and /health's."""
    latencies, health, failures = [], [], []
    # Pooled connections expire before the server's keep-alive deadline (at least 1 s in the tests).
    limits = httpx.Limits(max_connections=NORMAL_IN_FLIGHT + 1, keepalive_expiry=0.5)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:

        async def chats():
            while not stop.is_set():
                t = time.perf_counter()
                r = await client.post("/v1/chat/completions", json={**NORMAL_BODY, "model": model})
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t)
                else:
                    failures.append(r.status_code)

        async def probe_health():
            while not stop.is_set():
                t = time.perf_counter()
                r = await client.get("/health")
                health.append((time.perf_counter() - t, r.status_code))
                await asyncio.sleep(0.1)

        await asyncio.gather(*(chats() for _ in range(NORMAL_IN_FLIGHT)), probe_health())
    return summarize(latencies, health, failures)


def summarize(latencies, health, failures) -> dict:
    ms = sorted(x * 1e3 for x in latencies)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))] if ms else None  # noqa: E731
    return {
        "requests": len(ms),
        "failed": failures,
        "p50_ms": statistics.median(ms) if ms else None,
        "p95_ms": pick(0.95),
        "health_max_ms": max((h[0] * 1e3 for h in health), default=None),
        "health_not_200": [h[1] for h in health if h[1] != 200],
    }


async def measure_during(base: str, model: str, probe, min_seconds: float = 2.0) -> tuple[dict, dict]:
    """Runs `probe` (an async callable, or None for the unloaded baseline) with normal traffic
    alongside; returns (normal traffic summary, the probe's result)."""
    stop = asyncio.Event()
    traffic = asyncio.create_task(normal_traffic(base, model, stop))
    started = time.perf_counter()
    result = await probe() if probe else {}
    await asyncio.sleep(max(0.0, min_seconds - (time.perf_counter() - started)))
    stop.set()
    return await traffic, result


# ---- the probes -----------------------------------------------------------------------------


async def timed_post(client: httpx.AsyncClient, path: str, **kw) -> dict:
    t = time.perf_counter()
    try:
        r = await client.post(path, **kw)
    except httpx.TransportError as e:
        # A reset instead of an answer: recorded, and the test's status check names it.
        return {"status": None, "error": repr(e), "seconds": round(time.perf_counter() - t, 3)}
    return {"status": r.status_code, "seconds": round(time.perf_counter() - t, 3),
            "retry_after": r.headers.get("retry-after"), "code": error_code(r)}


def error_code(r: httpx.Response):
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def many_long_stop_strings(base: str, model: str, max_tokens: int = 200) -> dict:
    """Two streams with the most and longest stop strings allowed, and one over the limit."""
    stops = [f"{k:02d}" + "z" * 1022 for k in range(64)]
    body = {"model": model, "prompt": "a b c", "max_tokens": max_tokens, "stop": stops,
            "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:

        async def stream():
            t = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    pass
                return {"status": r.status_code, "seconds": round(time.perf_counter() - t, 3)}

        streams = await asyncio.gather(stream(), stream())
        over = await timed_post(client, "/v1/completions",
                                json={"model": model, "prompt": "x", "stop": ["s"] * 1000})
    return {"streams": streams, "over_limit": over}


async def huge_prompts(base: str, model: str, megabytes: int = 31) -> dict:
    """A prompt string and a token-id list of `megabytes` MB (over the body limit), and ones
    just under a 1 MiB body that cannot fit the context either."""
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        words = ("lorem ipsum dolor sit amet " * ((megabytes << 20) // 27 + 1))[: megabytes << 20]
        big_text = json.dumps({"model": model, "prompt": words, "max_tokens": 1})
        ids = ",".join(["11"] * ((megabytes << 20) // 3))
        big_ids = '{"model": "%s", "prompt": [%s], "max_tokens": 1}' % (model, ids)
        headers = {"content-type": "application/json"}
        out = {
            "text_over_body_limit": await timed_post(client, "/v1/completions", content=big_text, headers=headers),
            "ids_over_body_limit": await timed_post(client, "/v1/completions", content=big_ids, headers=headers),
        }
        under = (1 << 20) - 1024
        out["text_under_body_limit"] = await timed_post(
            client, "/v1/completions", json={"model": model, "prompt": words[:under], "max_tokens": 1})
        out["chat_under_body_limit"] = await timed_post(
            client, "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": words[:under]}], "max_tokens": 1})
        out["ids_under_body_limit"] = await timed_post(
            client, "/v1/completions", json={"model": model, "prompt": [11] * (under // 4), "max_tokens": 1})
    return out


async def request_shapes(base: str, model: str) -> dict:
    """Requests that can never be served as asked, and bodies that are not what they claim."""
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        post = lambda path, **kw: timed_post(client, path, **kw)  # noqa: E731
        bad_call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": 5}]}
        return {
            "prompts_times_n": await post("/v1/completions",
                                          json={"model": model, "prompt": ["hi"] * 100, "n": 128}),
            "prompts_2000": await post("/v1/completions",
                                       json={"model": model, "prompt": ["hi"] * 2000, "max_tokens": 1}),
            "malformed_tool_calls": await post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "x"}, bad_call], "max_tokens": 1}),
            "form_post": await post("/v1/completions", content="prompt=hi",
                                    headers={"content-type": "application/x-www-form-urlencoded"}),
        }


async def open_connection(host: str, port: int):
    return await asyncio.wait_for(asyncio.open_connection(host, port), timeout=5)


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> tuple[bool, bytes]:
    """Whether the server closes the connection within `within` seconds (what it sent first)."""
    try:
        data = await asyncio.wait_for(reader.read(4096), timeout=within)
        rest = data
        while data:
            data = await asyncio.wait_for(reader.read(4096), timeout=within)
            rest += data
        return True, rest
    except (asyncio.TimeoutError, ConnectionError):
        return False, b""


async def idle_and_slow_connections(host: str, port: int, idle: int, keep_alive: float,
                                    body_timeout: float) -> dict:
    """`idle` connections that send nothing, one that trickles its headers and one that trickles
    its body: all must be closed by the server within its deadlines."""
    raise_fd_limit(idle + 256)
    conns = []
    for _ in range(idle):
        try:
            conns.append(await open_connection(host, port))
        except (OSError, asyncio.TimeoutError):
            break
    slow_head_r, slow_head_w = await open_connection(host, port)
    slow_head_w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")

    async def trickle_head():
        for _ in range(int(keep_alive * 4) + 4):
            await asyncio.sleep(0.5)
            try:
                slow_head_w.write(b"X-Slow: 1\r\n")
                await slow_head_w.drain()
            except ConnectionError:
                return

    slow_body_r, slow_body_w = await open_connection(host, port)
    slow_body_w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    trickler = asyncio.create_task(trickle_head())
    deadline = max(keep_alive, body_timeout) + 3
    t = time.perf_counter()
    idle_closed = await asyncio.gather(*(closed_by_server(r, deadline) for r, _ in conns))
    head_closed, _ = await closed_by_server(slow_head_r, deadline)
    body_closed, body_answer = await closed_by_server(slow_body_r, deadline)
    trickler.cancel()
    for _, w in conns + [(None, slow_head_w), (None, slow_body_w)]:
        w.close()
    return {
        "idle_opened": len(conns),
        "idle_closed_by_server": sum(1 for c, _ in idle_closed if c),
        "slow_head_closed": head_closed,
        "slow_body_status": body_answer.split(b"\r\n", 1)[0].decode(errors="replace"),
        "slow_body_closed": body_closed,
        "seconds": round(time.perf_counter() - t, 2),
    }


async def over_the_connection_limit(host: str, port: int, limit: int) -> dict:
    """`limit` connections held open, then one more: it must get 503 with Retry-After."""
    raise_fd_limit(limit + 256)
    held = [await open_connection(host, port) for _ in range(limit)]
    reader, writer = await open_connection(host, port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    _, answer = await closed_by_server(reader, 5)
    for _, w in held + [(None, writer)]:
        w.close()
    head = answer.split(b"\r\n\r\n", 1)[0].decode(errors="replace").lower()
    return {"status_line": head.split("\r\n", 1)[0], "retry_after": "retry-after: 1" in head,
            "json_body": b'"too_many_connections"' in answer}
