"""Starting and stopping the real mla-serve binary for the end-to-end tests.

The suite builds nothing: it runs the binary named by MLA_SERVE_BIN, else the newer of
target/release/mla-serve and target/debug/mla-serve (build one first: `cargo build -p mla-serve`).
"""

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import openai
import requests

ROOT = Path(__file__).resolve().parents[2]
# A GPU model with dummy weights captures its graphs first (a minute or two).
STARTUP_TIMEOUT_S = float(os.environ.get("MLA_SERVE_STARTUP_S", "120"))


def binary() -> Path:
    env = os.environ.get("MLA_SERVE_BIN")
    if env:
        return Path(env)
    candidates = [ROOT / "target" / p / "mla-serve" for p in ("release", "debug")]
    found = [c for c in candidates if c.exists()]
    if not found:
        raise RuntimeError(
            "no mla-serve binary: run `cargo build -p mla-serve` (or set MLA_SERVE_BIN)"
        )
    return max(found, key=lambda p: p.stat().st_mtime)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One mla-serve process on a free port; its log goes to a temp file shown on failure."""

    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="mla-serve-", suffix=".log", delete=False)
        # The caller's arguments first, so a command line may start as vLLM's does (`serve MODEL`).
        cmd = [str(binary()), *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + STARTUP_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mla-serve exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if requests.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"mla-serve did not become healthy:\n{self.log_text()}")

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        # Retries would hide the status codes the tests check (503 is retried by default).
        return openai.OpenAI(base_url=self.base + "/v1", max_retries=0, timeout=120, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        kw.setdefault("api_key", "unused")
        return openai.AsyncOpenAI(base_url=self.base + "/v1", max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict:
        """Unlabelled view of /metrics: {series{labels}: value} plus {series: value} per name."""
        out = {}
        for line in requests.get(self.base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("#") or not line:
                continue
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
            out.setdefault(key.split("{")[0], float(value))
        return out

    def stop(self, sig=signal.SIGTERM, timeout=30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def free_addr() -> str:
    """A free 127.0.0.1 address for --dist-init-addr."""
    return f"127.0.0.1:{free_port()}"


def start_node(node_rank: int, addr: str, flags: list, *extra: str, nnodes: int = 2, env: dict | None = None):
    """A node other than 0 of an `--nnodes` layout (it serves no HTTP), as a plain process; returns
    the process and its log file's path."""
    log = tempfile.NamedTemporaryFile(prefix=f"mla-node{node_rank}-", suffix=".log", delete=False)
    cmd = [str(binary()), *flags, "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", addr, *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return proc, log.name


def run_cli(*args: str, env: dict | None = None, timeout=60) -> subprocess.CompletedProcess:
    """Runs the binary to completion (for flags that must fail at start)."""
    return subprocess.run(
        [str(binary()), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
