#!/usr/bin/env python3
"""Runs vLLM's and SGLang's own OpenAI-server tests, unchanged, against mla-serve.

The peers' files are taken from their git repositories (a checkout or a bare mirror) into a
work folder outside this repository; only their server launch is replaced, by the shims in
scripts/peer_shims/ (our code): vLLM's `tests/utils.py` RemoteOpenAIServer and SGLang's
`popen_launch_server` start `mla-serve --served-model-name <their model>` on the bundled demo
model, and the peers' own Python packages are import-time stubs, so a test that needs them fails
with PeerInternal. `peer_shims/launch.py` lists the peer flags that are dropped because they
bind to the peer's model or hardware; every other flag reaches mla-serve.

    scripts/peer_suites.py --vllm DIR --sglang DIR [--bin target/debug/mla-serve]

Needs: pytest, pytest-asyncio, openai, requests, transformers (tokenizers only), jsonschema,
regex, prometheus_client, numpy, psutil. Prints one line per test file and writes JUnit XML
(every test's outcome and message) to the work folder for classification.
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIMS = ROOT / "scripts" / "peer_shims"

# The files the issue names (issue 27): the OpenAI-server tests that start a server.
VLLM_REV = "fca252d59efdb627549e5677263c69709590c982"
VLLM_FILES = [
    "tests/entrypoints/openai/chat_completion/test_batched_chat_completions.py",
    "tests/entrypoints/openai/chat_completion/test_chat.py",
    "tests/entrypoints/openai/chat_completion/test_chat_completion.py",
    "tests/entrypoints/openai/chat_completion/test_chat_echo.py",
    "tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py",
    "tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py",
    "tests/entrypoints/openai/chat_completion/test_enable_force_include_usage.py",
    "tests/entrypoints/openai/chat_completion/test_include_reasoning.py",
    "tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py",
    "tests/entrypoints/openai/chat_completion/test_root_path.py",
    "tests/entrypoints/openai/completion/test_completion.py",
    "tests/entrypoints/openai/completion/test_token_in_token_out.py",
    "tests/entrypoints/openai/models/test_models.py",
    "tests/entrypoints/openai/test_chunked_prompt.py",
    "tests/entrypoints/openai/test_return_token_ids.py",
    "tests/entrypoints/openai/test_return_tokens_as_ids.py",
    "tests/entrypoints/serve/instrumentator/test_metrics.py",
    "tests/entrypoints/serve/tokenize/test_tokenization.py",
]
SGLANG_REV = "28c79dc84ab8d6f2a35dd00a543f7961e90c39c9"
SGLANG_FILES = [
    "test/srt/openai_server/basic/test_openai_server.py",
    "test/srt/openai_server/features/test_cache_report.py",
    "test/srt/openai_server/features/test_enable_thinking.py",
    "test/srt/openai_server/features/test_json_constrained.py",
    "test/srt/openai_server/features/test_json_mode.py",
    "test/srt/openai_server/features/test_openai_server_ebnf.py",
    "test/srt/openai_server/features/test_reasoning_content.py",
    "test/srt/openai_server/function_call/test_openai_function_calling.py",
    "test/srt/openai_server/function_call/test_tool_choice.py",
    "test/srt/openai_server/validation/test_large_max_new_tokens.py",
    "test/srt/openai_server/validation/test_matched_stop.py",
    "test/srt/openai_server/validation/test_openai_server_ignore_eos.py",
    "test/srt/openai_server/validation/test_request_length_validation.py",
    "test/srt/test_regex_constrained.py",
]
# Tests that would hang: this one polls SGLang's own log output for a line mla-serve never writes.
DESELECT = [
    "test/srt/openai_server/validation/test_large_max_new_tokens.py::TestLargeMaxNewTokens::test_chat_completion",
]


def extract(repo: str, rev: str, paths: list, dest: Path):
    """`git archive` of `paths` at `rev` into `dest` (works on bare mirrors too)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", repo, "archive", rev, *paths], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def prepare_vllm(repo: str, work: Path) -> Path:
    tree = work / "vllm"
    extract(repo, VLLM_REV, ["tests/entrypoints"], tree)
    (tree / "tests" / "__init__.py").touch()
    for shim in ("utils.py", "conftest.py"):
        shutil.copy(SHIMS / "vllm_tests" / shim, tree / "tests" / shim)
    (tree / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    return tree


def prepare_sglang(repo: str, work: Path) -> Path:
    tree = work / "sglang"
    extract(repo, SGLANG_REV, ["test/srt/openai_server", "test/srt/test_regex_constrained.py"], tree)
    shutil.copytree(SHIMS / "sglang_pkg" / "sglang", tree / "sglang", dirs_exist_ok=True)
    return tree


def run(tree: Path, files: list, env: dict, junit: Path, extra: list) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    cmd += [f"--junitxml={junit}", *extra, *files]
    cmd += [f"--deselect={d}" for d in DESELECT if d.split("::")[0] in files]
    subprocess.run(cmd, cwd=tree, env=env)


def summary(junit: Path) -> dict:
    """{file: [passed, failed, errors, skipped]} from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        key = case.get("classname", "").split(".")
        name = next((k for k in key if k.startswith("test_")), ".".join(key))
        row = out.setdefault(name, [0, 0, 0, 0])
        kinds = [c.tag for c in case]
        row[1 if "failure" in kinds else 2 if "error" in kinds else 3 if "skipped" in kinds else 0] += 1
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", help="vLLM repository (checkout or bare mirror)")
    ap.add_argument("--sglang", help="SGLang repository (checkout or bare mirror)")
    ap.add_argument("--bin", default=str(ROOT / "target" / "debug" / "mla-serve"))
    ap.add_argument("--work", default=None, help="work folder (default: a new temporary one)")
    ap.add_argument(
        "--drop-flag", action="append", default=[], metavar="FLAG[:VALUES]",
        help="also drop this peer flag (taking VALUES values, default 0), e.g. --max-logprobs:1",
    )
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments, e.g. -k return_token")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="peer-suites-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "MLA_SERVE_BIN": str(Path(a.bin).resolve()),
        "MLA_DEMO_TOKENIZER": str(ROOT / "assets" / "demo"),
        "PEER_HARNESS_LOG": str(work / "launches.log"),
        "TOKENIZERS_PARALLELISM": "false",
        "PEER_DROP_FLAGS": ",".join(a.drop_flag),
    }
    results = {}
    if a.vllm:
        tree = prepare_vllm(a.vllm, work)
        vllm_env = {**env, "PYTHONPATH": os.pathsep.join([str(tree), str(SHIMS)]), "PEER_VLLM_TREE": str(tree)}
        run(tree, VLLM_FILES, vllm_env, work / "vllm.xml", a.pytest_args)
        results["vllm"] = summary(work / "vllm.xml")
    if a.sglang:
        tree = prepare_sglang(a.sglang, work)
        # SGLang's tests share one fixed URL; a free port lets two runs go side by side.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        sglang_env = {**env, "PYTHONPATH": os.pathsep.join([str(tree), str(SHIMS)]), "PEER_SGLANG_PORT": str(port)}
        run(tree, SGLANG_FILES, sglang_env, work / "sglang.xml", a.pytest_args)
        results["sglang"] = summary(work / "sglang.xml")
    for peer, files in results.items():
        total = [sum(r[i] for r in files.values()) for i in range(4)]
        print(f"\n{peer}: {total[0]} passed, {total[1]} failed, {total[2]} errors, {total[3]} skipped")
        for name, (p, f, e, s) in sorted(files.items()):
            print(f"  {name:55} passed {p:3} failed {f:3} errors {e:3} skipped {s:3}")
    print(f"\nJUnit XML and the launch log: {work}")


if __name__ == "__main__":
    main()
