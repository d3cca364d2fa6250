"""Stand-in for vLLM's tests/conftest.py: the stubs for `vllm`, and the demo tokenizer wherever a
test loads the peer's model's tokenizer (the served model is the demo)."""

import socket
import sys
import types

import launch
import peer_stub


def _get_tokenizer(*a, **k):
    return launch.demo_tokenizer()


def _open_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_version = types.SimpleNamespace(__version__="0.0.0", _prev_minor_version=lambda: "0.0")
# torch too: test files import it at the top, for tests that need a real model's tensors.
peer_stub.install(["vllm", "torch"], {
    "vllm.tokenizers.get_tokenizer": _get_tokenizer,
    "vllm.transformers_utils.tokenizer.get_tokenizer": _get_tokenizer,
    "vllm.utils.network_utils.get_open_port": _open_port,
    "vllm.version": _version,
})
sys.modules["vllm.version"] = _version

import huggingface_hub  # noqa: E402
import pytest  # noqa: E402
import tempfile  # noqa: E402
import transformers  # noqa: E402


def _no_hub(*a, **k):
    # LoRA adapters and other downloads: nothing can be fetched here, and the served model has no
    # adapters; tests that use them fail at the server (unknown model), classified out of scope.
    return tempfile.mkdtemp(prefix="peer-hub-")


huggingface_hub.snapshot_download = _no_hub

transformers.AutoTokenizer.from_pretrained = classmethod(lambda cls, *a, **k: launch.demo_tokenizer())


@pytest.fixture(scope="session")
def local_asset_server():
    # vLLM's conftest serves image and audio assets; only multimodal tests use them.
    return None


class LocalAssetServer:
    def __init__(self, *a, **k):
        raise peer_stub.PeerInternal("LocalAssetServer (multimodal assets) is the peer's test helper")
