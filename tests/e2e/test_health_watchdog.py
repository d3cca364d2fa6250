"""A hung step (MLA_TEST_HANG_STEP, a test hook: the engine's Nth step never returns, as on a
hung device) must not leave the server looking healthy with its clients waiting forever: past
--watchdog-timeout the engine is declared dead, every request in flight is answered with the
reason, /health turns 503 while the server drains, and the process exits non-zero."""

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import requests

from server import Server


def test_a_hung_step_fails_its_requests_and_stops_the_server():
    server = Server("--watchdog-timeout", "2", "--shutdown-timeout", "1", env={"MLA_TEST_HANG_STEP": "3"})
    try:
        client = server.client()
        model = client.models.list().data[0].id

        def plain(i):
            try:
                client.completions.create(model=model, prompt=f"request {i}", max_tokens=40,
                                          extra_body={"ignore_eos": True})
                return "completed"
            except openai.APIStatusError as e:
                return f"{e.status_code} {e.message}"

        def streamed(_):
            try:
                for _chunk in client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=40, stream=True,
                        extra_body={"ignore_eos": True}):
                    pass
                return "completed"
            except openai.APIError as e:
                return f"stream error {e.message}"

        started = time.time()
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda f: f(0), [plain, plain, streamed]))
        answered_after = time.time() - started
        assert all("past the watchdog" in r for r in results), results
        assert results[0].startswith("500") and results[2].startswith("stream error"), results
        assert answered_after < 15, f"answered after {answered_after:.1f} s"

        deadline = time.time() + 30
        while server.proc.poll() is None and time.time() < deadline:
            try:
                health = requests.get(server.base + "/health", timeout=1)
                if health.status_code == 503:
                    assert "past the watchdog" in health.json()["error"]["message"]
                else:
                    assert health.status_code != 200, "/health is 200 over a hung engine"
            except requests.RequestException:
                pass  # the listener is closed while the server drains
            time.sleep(0.1)
        assert server.proc.poll() is not None, "the server did not exit within 30 s of the watchdog"
        assert server.proc.returncode != 0
        log = server.log_text()
        assert "hangs on purpose" in log and "past the watchdog" in log, log[-2000:]
    finally:
        server.stop()
