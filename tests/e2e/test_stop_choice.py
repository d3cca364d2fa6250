"""A stop string ends only its own choice, in the engine too: the other choice of an n=2 request is
unchanged, the stopped one is not decoded on, and /metrics counts one stop and one length among
the completions, and the request once, as truncated (length)."""

import time

from server import Server

MAX_TOKENS = 300
PROMPT = [0, 21, 34, 55]
REQUEST = dict(model="demo", prompt=PROMPT, n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=5, extra_body={"ignore_eos": True})


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def early_stop_string(first: str, second: str) -> str:
    """A short piece of `first` near its start that `second` never contains."""
    for start in range(4, 40):
        for length in (4, 5, 6, 8):
            piece = first[start : start + length]
            if len(piece) == length and "\ufffd" not in piece and piece.strip() and piece not in second:
                return piece
    raise AssertionError(f"no usable stop string in {first[:60]!r}")


def finished(m: dict, reason: str, series: str = "mla:completion_success_total") -> float:
    return m.get(f'{series}{{model_name="demo",finished_reason="{reason}"}}', 0)


def test_a_stop_string_ends_one_choice_and_leaves_the_other_untouched():
    server = Server("--max-model-len", "1024")
    try:
        client = server.client()
        full = sorted(client.completions.create(**REQUEST).choices, key=lambda c: c.index)
        assert [c.finish_reason for c in full] == ["length", "length"]
        assert full[0].text != full[1].text, "the seeded choices differ"
        stop = early_stop_string(full[0].text, full[1].text)
        wait_for(lambda: server.metrics()["mla:num_requests_running"] == 0, what="the first request to end")
        before = server.metrics()

        r = client.completions.create(**REQUEST, stop=[stop])
        got = sorted(r.choices, key=lambda c: c.index)
        assert (got[0].text, got[0].finish_reason) == (full[0].text[: full[0].text.index(stop)], "stop")
        # The other choice is exactly what it was without the early stop.
        assert (got[1].text, got[1].finish_reason) == (full[1].text, "length")

        def idle():
            m = server.metrics()
            return m["mla:num_requests_running"] == 0 and m["mla:num_requests_waiting"] == 0 and m["mla:kv_cache_usage_perc"] == 0

        wait_for(idle, what="zero running requests and zero KV usage")
        after = server.metrics()
        assert finished(after, "stop") - finished(before, "stop") == 1
        assert finished(after, "length") - finished(before, "length") == 1
        assert finished(after, "abort") - finished(before, "abort") == 0
        # The request itself counts once, as truncated: one of its answers is.
        series = "mla:request_success_total"
        moved = [finished(after, r, series) - finished(before, r, series) for r in ("stop", "length", "abort")]
        assert moved == [0, 1, 0]
        # The stopped choice was decoded at most a few steps past its stop string, not for all
        # MAX_TOKENS steps of its sibling.
        generated = after["mla:generation_tokens_total"] - before["mla:generation_tokens_total"]
        delivered = r.usage.completion_tokens
        assert delivered < 2 * MAX_TOKENS
        assert delivered <= generated <= delivered + 50, (generated, delivered)
    finally:
        server.stop()
