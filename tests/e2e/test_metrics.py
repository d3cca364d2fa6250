"""/metrics of the real binary: valid Prometheus exposition, request_success_total moving by one
per request whatever its n, and every series the Grafana dashboard in docs/grafana queries."""

import json
import math
import re
import time

import requests

from server import ROOT, Server

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse(text: str) -> dict:
    """{family: {"type", "help", "samples": [(name, labels, value)]}}, checking the format:
    HELP then TYPE once per family before its samples, samples only of the open family, and
    histogram buckets that rise to le="+Inf" equal to _count."""
    assert text.endswith("\n")
    families, current, help_for = {}, None, None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            help_for, _, help_text = line[7:].partition(" ")
            assert help_text.strip(), line
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert name == help_for and name not in families, line
            assert kind in ("counter", "gauge", "histogram"), line
            families[name] = {"type": kind, "samples": []}
            current, help_for = name, None
        else:
            m = SAMPLE.match(line)
            assert m and current, line
            name, raw, value = m.groups()
            labels = {}
            rest = raw or ""
            while rest:
                lm = LABEL.match(rest)
                assert lm, line
                labels[lm.group(1)] = lm.group(2)
                rest = rest[lm.end():]
            kind = families[current]["type"]
            allowed = [current + s for s in ("_bucket", "_sum", "_count")] if kind == "histogram" else [current]
            assert name in allowed, f"{name} inside {current}"
            families[current]["samples"].append((name, labels, float(value.replace("Inf", "inf"))))
    for name, f in families.items():
        if f["type"] != "histogram":
            continue
        buckets = [(float(l["le"].replace("Inf", "inf")), v) for n, l, v in f["samples"] if n.endswith("_bucket")]
        count = [v for n, _, v in f["samples"] if n == name + "_count"]
        assert [n for n, _, _ in f["samples"] if n == name + "_sum"], name
        assert buckets and buckets[-1][0] == math.inf and [buckets[-1][1]] == count, name
        assert all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), (name, buckets)
    return families


def value(families: dict, name: str, **labels) -> float:
    family = families[re.sub(r"_(bucket|sum|count)$", "", name)] if name not in families else families[name]
    found = [v for n, l, v in family["samples"] if n == name and all(l.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def scrape(server) -> dict:
    return parse(requests.get(server.base + "/metrics", timeout=10).text)


def wait_idle(server):
    deadline = time.time() + 30
    while time.time() < deadline:
        m = scrape(server)
        busy = [value(m, s) for s in ("mla:num_requests_running", "mla:num_requests_waiting", "mla:kv_cache_usage_perc")]
        if busy == [0, 0, 0]:
            return m
        time.sleep(0.05)
    raise AssertionError("the server did not become idle")


def test_metrics_of_the_binary():
    server = Server("--max-model-len", "1024")
    try:
        client = server.client()
        before = wait_idle(server)
        r = client.completions.create(model="demo", prompt=[0, 5, 9], n=3, max_tokens=6, extra_body={"ignore_eos": True})
        assert [c.finish_reason for c in r.choices] == ["length"] * 3
        after = wait_idle(server)

        def moved(name, **labels):
            return value(after, name, **labels) - value(before, name, **labels)

        assert [moved("mla:request_success_total", finished_reason=x) for x in ("stop", "length", "abort")] == [0, 1, 0]
        assert moved("mla:completion_success_total", finished_reason="length") == 3
        assert moved("mla:request_generation_tokens_sum") == 18
        assert moved("mla:request_params_n_sum") == 3
        assert moved("mla:request_prefill_time_seconds_count") == 1
        assert all(s[1].get("model_name") == "demo" for f in after.values() for s in f["samples"])

        dashboard = json.loads((ROOT / "docs/grafana/mla-serve.json").read_text())
        exprs = re.findall(r'"(?:expr|query)": "([^"\\]*(?:\\.[^"\\]*)*)"', json.dumps(dashboard))
        names = {n for e in exprs for n in re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]*", e)}
        exposed = {n for f in after.values() for n, _, _ in f["samples"]}
        assert len(names) >= 10
        assert names <= exposed, sorted(names - exposed)
    finally:
        server.stop()
