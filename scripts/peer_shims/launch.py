"""Starts mla-serve in place of a peer's server (vLLM's `vllm serve`, SGLang's launch_server).

The peer's command line is kept, except flags that bind to the peer's own model, hardware or
out-of-scope features (listed in DROP, each logged), and parser names, which become this
server's parsers for its DeepSeek model. Everything else goes to mla-serve unchanged, so a flag
it refuses shows up as a startup failure.
"""

import os
import signal
import subprocess
import tempfile
import time

import requests

# Set by scripts/peer_suites.py.
BIN = os.environ["MLA_SERVE_BIN"]
DEMO_TOKENIZER = os.environ["MLA_DEMO_TOKENIZER"]
LOG = os.environ["PEER_HARNESS_LOG"]

# flag -> number of values it takes. Model-, hardware- or feature-bound flags of the peers.
DROP = {
    "--dtype": 1, "--gpu-memory-utilization": 1, "--enable-lora": 0, "--lora-modules": -1,
    "--max-lora-rank": 1, "--max-loras": 1, "--max-cpu-loras": 1, "--enable-prompt-embeds": 0,
    "--limit-mm-per-prompt": 1, "--tokenizer-mode": 1, "--model-impl": 1, "--load-format": 1,
    "--attention-backend": 1, "--grammar-backend": 1, "--enable-metrics": 0, "--is-embedding": 0,
    "--enable-cache-report": 0, "--enable-return-hidden-states": 0, "--mem-fraction-static": 1,
    "--cuda-graph-max-bs": 1, "--speculative-algorithm": 1, "--speculative-draft-model-path": 1,
    "--speculative-num-steps": 1, "--speculative-eagle-topk": 1, "--speculative-num-draft-tokens": 1,
    "--hf-overrides": 1, "--tp-size": 1, "--disable-cuda-graph": 0,
    "--chat-template": 1, "--generation-config": 1, "--kv-cache-memory": 1,
    "--structured-outputs-config.backend": 1, "--max-total-tokens": 1, "--disable-overlap-schedule": 0,
    "--show-hidden-metrics-for-version": 1,
    # Features not served here (the tests that use them fail, classified "not served"); dropped so
    # that the other tests of their files run.
    "--enable-tokenizer-info-endpoint": 0, "--root-path": 1,
    # SGLang's, by the abbreviations its argparse accepts.
    "--max-total-token": 1, "--decode-log-interval": 1,
    "--override-generation-config": 1, "--tokenizer": 1,
}
# More flags to drop for a run (`peer_suites.py --drop-flag`): to compare an older binary that
# refuses them on what the tests check after startup.
for _flag in filter(None, os.environ.get("PEER_DROP_FLAGS", "").split(",")):
    _name, _, _values = _flag.partition(":")
    DROP[_name] = int(_values or 0)
# SGLang's spellings of flags mla-serve knows under vLLM's name.
RENAME = {
    "--max-running-requests": "--max-num-seqs",
    "--chunked-prefill-size": "--max-num-batched-tokens",
    "--context-length": "--max-model-len",
    "--context-len": "--max-model-len",
}


# The demo model's context (max_position_embeddings): longer --max-model-len values of the
# peers' models are cut to it.
DEMO_MAX_MODEL_LEN = 4096


def log(msg):
    with open(LOG, "a") as f:
        f.write(msg + "\n")


def translate(args):
    out, dropped, i = [], [], 0
    args = [str(a) for a in args]
    while i < len(args):
        a = args[i]
        name, eq, val = a.partition("=")
        if name in DROP:
            n = DROP[name]
            if eq or n == 0:
                dropped.append(a)
                i += 1
            elif n == -1:
                j = i + 1
                while j < len(args) and not args[j].startswith("--"):
                    j += 1
                dropped.append(" ".join(args[i:j]))
                i = j
            else:
                dropped.append(" ".join(args[i:i + 1 + n]))
                i += 1 + n
            continue
        if name == "--reasoning-parser":
            out += ["--reasoning-parser", "deepseek_r1"]
            i += 1 if eq else 2
            continue
        if name == "--tool-call-parser":
            out += ["--tool-call-parser", "deepseek_v3"]
            i += 1 if eq else 2
            continue
        if name in RENAME:
            a = RENAME[name] + (eq + val if eq else "")
            name = RENAME[name]
        if name == "--max-model-len":
            value = int(val if eq else args[i + 1])
            out += ["--max-model-len", str(min(value, DEMO_MAX_MODEL_LEN))]
            i += 1 if eq else 2
            continue
        out.append(a)
        i += 1
    return out, dropped


class Process:
    def __init__(self, model, args, port, host="127.0.0.1", api_key=None, env=None, sglang=False):
        flags, dropped = translate(args)
        if sglang and "--tool-call-parser" in flags and "--enable-auto-tool-choice" not in flags:
            # SGLang lets `tool_choice: "auto"` through whenever a parser is set.
            flags.append("--enable-auto-tool-choice")
        if not sglang and "--metrics-prefix" not in DROP:
            # vLLM's tests read vLLM's metric names: the prefix an operator with vLLM dashboards sets.
            flags += ["--metrics-prefix", "vllm"]
        cmd = [BIN, "--served-model-name", model, "--host", host, "--port", str(port)]
        cmd += flags
        if api_key:
            cmd += ["--api-key", api_key]
        log(f"launch {model}: {' '.join(cmd)}  (dropped: {dropped})")
        self.logfile = tempfile.NamedTemporaryFile(prefix="peer-mla-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.logfile, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self.pid = self.proc.pid
        self.base = f"http://{host}:{port}"

    def wait_ready(self, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                text = open(self.logfile.name, errors="replace").read()[-2000:]
                log(f"STARTUP FAILED rc={self.proc.returncode}: {text}")
                raise RuntimeError(f"mla-serve exited at startup ({self.proc.returncode}):\n{text}")
            try:
                if requests.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("mla-serve did not become healthy")

    def poll(self):
        return self.proc.poll()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_TOKENIZER = []


def demo_tokenizer():
    # Not through AutoTokenizer, which the vLLM conftest points here.
    if not _TOKENIZER:
        from transformers import PreTrainedTokenizerFast
        _TOKENIZER.append(PreTrainedTokenizerFast.from_pretrained(DEMO_TOKENIZER))
    return _TOKENIZER[0]
