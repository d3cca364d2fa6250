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
# Every HTTP request of the probes gives up after this: the probes end in bounded time even
# against a server that hangs.
REQUEST_TIMEOUT_S = 60


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
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

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
    try:
        result = await probe() if probe else {}
        await asyncio.sleep(max(0.0, min_seconds - (time.perf_counter() - started)))
    finally:
        # Also when the probe fails or is cancelled: normal traffic must not outlive it.
        stop.set()
    return await traffic, result


# ---- the probes -----------------------------------------------------------------------------


# Normal traffic's median may be at most LATENCY_FACTOR x unloaded + LATENCY_SLACK_MS while a
# hostile probe runs (test_hostile_load.py, test_hostile_requests.py): the slack is for a 2-core
# CI machine where the test client itself competes for the CPU.
LATENCY_FACTOR = 3.0
LATENCY_SLACK_MS = 100.0


def assert_unaffected(baseline: dict, loaded: dict, what: str):
    """Normal traffic measured by `measure_during` beside a probe: none failed, /health answered
    200, and its median within the bound above of the unloaded `baseline`."""
    assert not loaded["failed"], f"{what}: normal requests failed: {loaded['failed']}"
    assert not loaded["health_not_200"], f"{what}: /health answered {loaded['health_not_200']}"
    bound = LATENCY_FACTOR * baseline["p50_ms"] + LATENCY_SLACK_MS
    assert loaded["p50_ms"] <= bound, f"{what}: median {loaded['p50_ms']:.0f} ms > {bound:.0f} ms"


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
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as client:

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
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as client:
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
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as client:
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


async def queue_full(base: str, model: str) -> dict:
    """Against a server with --max-num-seqs 1 --max-queued-requests 1: one long stream running,
    one waiting, then a third request, which must get 503 queue_full with Retry-After."""
    body = {"model": model, "prompt": [0, 1, 2], "max_tokens": 4000, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as client:
        async with client.stream("POST", "/v1/completions", json=body) as running:
            # A first token: it is scheduled. The iterator is kept: a half-read one that is
            # garbage-collected closes the connection, and the server aborts the request.
            tokens = running.aiter_bytes()
            await tokens.__anext__()
            async with client.stream("POST", "/v1/completions", json=body) as waiting:
                third = await timed_post(client, "/v1/completions", json={**body, "stream": False})
                streams = [{"status": running.status_code}, {"status": waiting.status_code}]
            await tokens.aclose()
    return {"streams": streams, "third": third}


async def open_connection(host: str, port: int):
    return await asyncio.wait_for(asyncio.open_connection(host, port), timeout=5)


async def watch_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, opened: float,
                      within: float) -> dict:
    """Reads what the server sends until it closes the connection or `within` seconds after
    `opened` pass. Returns whether it closed, when (seconds after `opened`), whether by a reset,
    and what it sent. Our side is closed as soon as the server's is, so the server's lingering
    close (and its refusal slot) ends at once."""
    answer, closed, reset = b"", False, False
    try:
        while True:
            left = opened + within - time.perf_counter()
            if left <= 0:
                break
            data = await asyncio.wait_for(reader.read(4096), timeout=left)
            if not data:
                closed = True
                break
            answer += data
    except asyncio.TimeoutError:
        pass
    except ConnectionError:
        closed = reset = True
    after = time.perf_counter() - opened
    writer.close()
    return {"opened": opened, "closed": closed, "reset": reset, "after_s": after, "answer": answer}


def most_at_once(intervals: list) -> int:
    """The most of the (start, end) intervals that overlap at one moment."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def status_line(answer: bytes) -> str:
    return answer.split(b"\r\n", 1)[0].decode(errors="replace")


def spread(seconds: list) -> list:
    """[min, median, max] of close times, rounded, for the record."""
    return [round(min(seconds), 3), round(statistics.median(seconds), 3), round(max(seconds), 3)] if seconds else []


async def trickle(writer: asyncio.StreamWriter, chunk: bytes, every: float, until: float):
    """Sends `chunk` every `every` seconds until `until` (perf_counter) or the server closes."""
    while time.perf_counter() < until:
        await asyncio.sleep(every)
        if writer.is_closing():
            return
        try:
            writer.write(chunk)
            await writer.drain()
        except ConnectionError:
            return


async def idle_and_slow_connections(host: str, port: int, idle: int, keep_alive: float,
                                    body_timeout: float, slack: float = 3.0) -> dict:
    """`idle` connections that send nothing, one that trickles header lines and one that
    trickles its body, each for longer than its deadline. The server must close the idle and
    slow-head ones once `keep_alive` (its --timeout-keep-alive, which bounds a request head
    from the moment a connection can send one) has passed since they opened, and answer the slow
    body 408 once `body_timeout` (--body-read-timeout) has passed since its head. Each is
    watched for its deadline plus `slack` seconds; the close times are recorded."""
    raise_fd_limit(idle + 256)
    t0 = time.perf_counter()
    within_head = keep_alive + slack
    watchers, open_failed = [], None
    for _ in range(idle):
        try:
            r, w = await open_connection(host, port)
        except (OSError, asyncio.TimeoutError) as e:
            open_failed = repr(e)
            break
        watchers.append(asyncio.create_task(watch_close(r, w, time.perf_counter(), within_head)))

    head_r, head_w = await open_connection(host, port)
    head_opened = time.perf_counter()
    head_w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    head_watch = asyncio.create_task(watch_close(head_r, head_w, head_opened, within_head))
    head_trickle = asyncio.create_task(trickle(head_w, b"X-Slow: 1\r\n", 0.25, head_opened + within_head))

    body_r, body_w = await open_connection(host, port)
    body_w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{\"prompt\": ")
    body_sent = time.perf_counter()
    within_body = body_timeout + slack
    body_watch = asyncio.create_task(watch_close(body_r, body_w, body_sent, within_body))
    body_trickle = asyncio.create_task(trickle(body_w, b" ", 0.25, body_sent + within_body))

    idle_got = await asyncio.gather(*watchers)
    head, body = await head_watch, await body_watch
    for task in (head_trickle, body_trickle):
        task.cancel()
    closed = [c["after_s"] for c in idle_got if c["closed"]]
    return {
        "idle_opened": len(watchers),
        "idle_open_failed": open_failed,
        "idle_closed_by_server": len(closed),
        "idle_reset": sum(1 for c in idle_got if c["reset"]),
        "idle_answered": sorted({status_line(c["answer"]) for c in idle_got if c["answer"]}),
        "idle_close_s": spread(closed),
        "slow_head_closed": head["closed"],
        "slow_head_close_s": round(head["after_s"], 3),
        "slow_head_answer": status_line(head["answer"]),
        "slow_body_status": status_line(body["answer"]),
        "slow_body_closed": body["closed"],
        "slow_body_close_s": round(body["after_s"], 3),
        "seconds": round(time.perf_counter() - t0, 2),
    }


async def flood_over_the_cap(base: str, host: str, port: int, flood: int, keep_alive: float,
                             slack: float = 3.0) -> dict:
    """`flood` connections that send nothing against a server whose --max-connections is below
    that, while /health is asked every 100 ms over one keep-alive connection opened before the
    flood. Connections within the cap sit idle until the keep-alive deadline closes them; those
    over it must be answered 503 with Retry-After and an OpenAI error body at once (or, past the
    server's bound on refusals in progress, closed unanswered). Afterwards a new connection must
    be served again."""
    raise_fd_limit(flood + 256)
    health, open_seen, stop = [], [], asyncio.Event()
    # One pooled connection, never left idle long enough to expire on either side.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=60)
    async with httpx.AsyncClient(base_url=base, timeout=10, limits=limits) as held:
        await held.get("/health")

        async def probe_health():
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    status = (await held.get("/health")).status_code
                    # The server's own count of the connections it holds: what the cap bounds.
                    # (Client-side intervals cannot tell it: a connect() completes in the
                    # kernel's backlog before the server accepts, and a close is seen late.)
                    for line in (await held.get("/metrics")).text.splitlines():
                        if line.startswith("mla:http_connections_open"):
                            open_seen.append(float(line.rsplit(" ", 1)[1]))
                except httpx.TransportError as e:
                    status = repr(e)
                health.append((time.perf_counter() - t, status))
                await asyncio.sleep(0.1)

        prober = asyncio.create_task(probe_health())
        t0 = time.perf_counter()
        watchers, open_failed = [], None
        for _ in range(flood):
            try:
                r, w = await open_connection(host, port)
            except (OSError, asyncio.TimeoutError) as e:
                open_failed = repr(e)
                break
            watchers.append(asyncio.create_task(watch_close(r, w, time.perf_counter(), keep_alive + slack)))
        got = await asyncio.gather(*watchers)
        stop.set()
        await prober
    flood_s = time.perf_counter() - t0

    refused = [c for c in got if c["answer"].startswith(b"HTTP/1.1 503")]
    heads = [c["answer"].split(b"\r\n\r\n", 1)[0].lower() for c in refused]
    silent = [c for c in got if c["closed"] and not c["answer"]]
    # Held ones wait for the keep-alive deadline; ones closed unanswered at once were refused.
    held_then_closed = [c for c in silent if c["after_s"] >= keep_alive / 2]

    # A fresh connection (a new client) is served again once the flood has gone.
    recovered_after_s, t = None, time.perf_counter()
    while recovered_after_s is None and time.perf_counter() - t < keep_alive + slack:
        try:
            async with httpx.AsyncClient(timeout=2) as fresh:
                if (await fresh.get(base + "/health")).status_code == 200:
                    recovered_after_s = round(time.perf_counter() - t, 3)
        except httpx.TransportError:
            pass
        if recovered_after_s is None:
            await asyncio.sleep(0.1)

    return {
        "flood_opened": len(got),
        "flood_open_failed": open_failed,
        "refused_503": len(refused),
        "refused_503_with_retry_after": sum(1 for h in heads if b"\r\nretry-after: " in h),
        "refused_503_json_body": sum(1 for c in refused if b'"too_many_connections"' in c["answer"]),
        "refused_503_close_s": spread([c["after_s"] for c in refused]),
        "closed_unanswered_at_once": len(silent) - len(held_then_closed),
        "held_until_keep_alive": len(held_then_closed),
        "held_close_s": spread([c["after_s"] for c in held_then_closed]),
        # As the client saw them (an upper bound of the server's count, for the record).
        "held_at_once_max": most_at_once([(c["opened"], c["opened"] + c["after_s"]) for c in held_then_closed]),
        "server_open_max": max(open_seen, default=None),
        "other_answers": sorted({status_line(c["answer"]) for c in got if c["answer"]} - {"HTTP/1.1 503 Service Unavailable"}),
        "not_closed_in_time": sum(1 for c in got if not c["closed"]),
        "health_on_held_connection": len(health),
        "health_not_200": [h[1] for h in health if h[1] != 200],
        "health_max_ms": round(max((h[0] * 1e3 for h in health), default=0.0), 1),
        "recovered_after_s": recovered_after_s,
        "seconds": round(flood_s, 2),
    }


# ---- issue 25: requests that took the whole server down or held it ----------------------------


def process_memory(pid: int) -> dict:
    """The process's resident memory now and at its peak (VmHWM), in MB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    mb = lambda key: int(fields[key].split()[0]) / 1024  # noqa: E731
    return {"rss_mb": round(mb("VmRSS"), 1), "peak_mb": round(mb("VmHWM"), 1)}


def ref_chain(links: int) -> dict:
    """A JSON schema whose definitions each refer to the next, `links` deep."""
    defs = {}
    for i in range(links):
        nxt = {"$ref": f"#/$defs/d{i + 1}"} if i + 1 < links else {"type": "integer"}
        defs[f"d{i}"] = {"type": "object", "properties": {"x": nxt}, "required": ["x"]}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(rules: int) -> str:
    """A Lark grammar of `rules` rules, each "a" and the next."""
    lines = ["start: r0"] + [f'r{i}: "a"' + (f" r{i + 1}" if i + 1 < rules else "") for i in range(rules)]
    return "\n".join(lines) + "\n"


def deep_and_empty_grammar_bodies(model: str) -> dict:
    """The requests of issue 25 items 1 and 2, and ones past each limit, by name: (path, body)."""
    chat = lambda **kw: ("/v1/chat/completions",  # noqa: E731
                         {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **kw})
    cmpl = lambda **kw: ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2, **kw})  # noqa: E731
    tool = lambda schema: [{"type": "function", "function": {"name": "f", "parameters": schema}}]  # noqa: E731
    return {
        # The issue's: a 250-definition $ref chain, three ways, and a 700-rule Lark chain.
        "ref_chain_250_guided_json": cmpl(guided_json=ref_chain(250)),
        "ref_chain_250_response_format": chat(response_format={
            "type": "json_schema", "json_schema": {"name": "deep", "schema": ref_chain(250)}}),
        "ref_chain_250_tool_required": chat(tools=tool(ref_chain(250)), tool_choice="required"),
        "lark_chain_700": cmpl(guided_grammar=lark_chain(700)),
        # Past the compiler's recursion bound, and past the Lark size limit.
        "ref_chain_2100_guided_json": cmpl(guided_json=ref_chain(2100)),
        "ref_chain_2100_tool_required": chat(tools=tool(ref_chain(2100)), tool_choice="required"),
        "lark_chain_2000": cmpl(guided_grammar=lark_chain(2000)),
        # Item 2: nothing can be generated, or nothing ever completes.
        "regex_allows_nothing": cmpl(guided_regex="[^\\s\\S]"),
        "lark_start_start": cmpl(guided_grammar="start: start"),
        "lark_never_ends": cmpl(guided_grammar='start: "a" start'),
    }


async def post_each(base: str, bodies: dict, pid: int | None) -> dict:
    """Sends each (path, body) in turn; after each, /health must answer within a second. With
    the server's `pid` (a local server), its memory at the end."""
    out = {}
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as client:
        for name, (path, body) in bodies.items():
            got = await timed_post(client, path, json=body)
            try:
                health = (await client.get("/health", timeout=1.0)).status_code
            except httpx.HTTPError as e:
                health = repr(e)
            out[name] = {**got, "health": health, "message": None}
            if got["status"] not in (None, 200):
                r = await client.post(path, json=body)
                out[name]["message"] = r.json()["error"]["message"]
    if pid is not None:
        out["memory"] = process_memory(pid)
    return out


def expensive_grammar_bodies(model: str) -> list:
    """Grammars as expensive as the limits allow, and the issue's 100 KB regex past them."""
    return [
        # A Lark token of 3200 optional items (just under 16 KiB): one regex, about 0.25 s and
        # 50 MB to compile.
        {"guided_grammar": 'start: "x" T\nT: ' + '"a"? ' * 3200 + '"b"\n'},
        # A regex at the optional-item limit and near the length limit.
        {"guided_regex": "a?" * 1024 + "a" * 14000},
        # The issue's: `a?` x 25000 then `a` x 25000 (12-32 s and 2.4 GB before).
        {"guided_regex": "a?" * 25000 + "a" * 25000},
    ]


async def expensive_grammar_clients(base: str, model: str, clients: int, seconds: float) -> dict:
    """`clients` clients sending expensive grammars in a loop for `seconds`: the statuses."""
    bodies = expensive_grammar_bodies(model)
    statuses: dict = {}
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def loop(i: int):
            k = i
            while time.perf_counter() < stop:
                body = {"model": model, "prompt": "x", "max_tokens": 8, **bodies[k % len(bodies)]}
                got = await timed_post(client, "/v1/completions", json=body)
                key = str(got["status"])
                statuses[key] = statuses.get(key, 0) + 1
                k += 1

        await asyncio.gather(*(loop(i) for i in range(clients)))
    return statuses


async def prompt_logprobs_amplifier(base: str, model: str, prompt_len: int, n: int) -> dict:
    """Item 4: one prompt of `prompt_len` ids, prompt_logprobs 20, `n` choices, and its `n: 1`
    twin; what each returned and how big. Then echo with logprobs 20 and the same n."""
    body = {"model": model, "prompt": [11] * prompt_len, "max_tokens": 1, "prompt_logprobs": 20}
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as client:
        out = {}
        for name, extra in (("n_1", {"n": 1}), ("n_many", {"n": n})):
            t = time.perf_counter()
            r = await client.post("/v1/completions", json={**body, **extra})
            choices = r.json()["choices"] if r.status_code == 200 else []
            out[name] = {
                "status": r.status_code, "bytes": len(r.content), "seconds": round(time.perf_counter() - t, 3),
                "choices": len(choices),
                "with_prompt_logprobs": [i for i, c in enumerate(choices) if c.get("prompt_logprobs")],
                "positions": len(choices[0]["prompt_logprobs"]) if choices else None,
            }
        echo = {**body, "n": n, "logprobs": 20, "echo": True}
        del echo["prompt_logprobs"]
        out["echo_n_many"] = await timed_post(client, "/v1/completions", json=echo)
    return out


async def tokenize_bodies(base: str, clients: int, pid: int | None) -> dict:
    """Item 5: `clients` concurrent /tokenize bodies just under 1 MiB, text and messages; with
    the server's `pid`, its memory after them."""
    words = ("lorem ipsum dolor sit amet " * 40000)[: (1 << 20) - 1024]
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as client:
        bodies = [{"prompt": words} if i % 2 == 0 else {"messages": [{"role": "user", "content": words}]}
                  for i in range(clients)]
        got = await asyncio.gather(*(timed_post(client, "/tokenize", json=b) for b in bodies))
    out = {"answers": sorted({(g["status"], g["code"]) for g in got}), "slowest_s": max(g["seconds"] for g in got)}
    if pid is not None:
        out["memory"] = process_memory(pid)
    return out
