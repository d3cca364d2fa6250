"""Stand-in for vLLM's tests/utils.py: RemoteOpenAIServer starts mla-serve (harness/launch.py)."""

import os
import socket

import launch
import openai
import pytest

VLLM_PATH = os.environ["PEER_VLLM_TREE"]
ROCM_ENV_OVERRIDES = {}
ROCM_EXTRA_ARGS = []
multi_gpu_only = pytest.mark.skip(reason="needs several GPUs")


def requires_fp8(f=None, *a, **k):
    return pytest.mark.skip(reason="needs FP8 hardware")(f) if callable(f) else pytest.mark.skip(reason="fp8")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model, vllm_serve_args, *, env_dict=None, seed=0, auto_port=True,
                 max_wait_seconds=None, override_hf_configs=None):
        args = list(vllm_serve_args)
        self.host = "127.0.0.1"
        self.uds = None
        if auto_port and "--port" not in args:
            self.port = _free_port()
        else:
            i = args.index("--port")
            self.port = int(args[i + 1])
            del args[i:i + 2]
        self.show_hidden_metrics = any(a.startswith("--show-hidden-metrics-for-version") for a in args)
        if "--api-key" in args:
            self.DUMMY_API_KEY = args[args.index("--api-key") + 1]
        self._proc = launch.Process(model, args, self.port, env=env_dict)
        self._proc.wait_ready(max_wait_seconds or 120)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._proc.stop()

    @property
    def url_root(self):
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts):
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)
