"""Stand-in for sglang/test/test_utils.py: popen_launch_server starts mla-serve."""
import os
import unittest

import launch

_LAUNCHED = {}

DEFAULT_URL_FOR_TEST = f"http://127.0.0.1:{os.environ.get('PEER_SGLANG_PORT', '22157')}"
STDOUT_FILENAME = "/tmp/peer-sglang-stdout.txt"
STDERR_FILENAME = "/tmp/peer-sglang-stderr.txt"
DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH = 600
CustomTestCase = unittest.TestCase


def __getattr__(name):
    # Every DEFAULT_*_MODEL_* name: the served model takes whatever name the test sends.
    if name.startswith("DEFAULT_") and ("MODEL" in name):
        return name.lower().replace("default_", "").replace("_for_test", "")
    raise AttributeError(name)


def popen_launch_server(model, base_url, timeout, api_key=None, other_args=(), env=None,
                        return_stdout_stderr=None, device="auto", pd_separated=False):
    _, host, port = base_url.split(":")
    p = launch.Process(model, list(other_args), int(port), host=host[2:], api_key=api_key, env=env,
                       sglang=True)
    _LAUNCHED[p.pid] = p
    p.wait_ready(min(timeout, 120))
    return p
