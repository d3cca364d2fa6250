#!/usr/bin/env bash
# Runs every GPU test on a machine with an NVIDIA Hopper GPU, from binaries built elsewhere
# (the GPU machine needs no Rust toolchain). Build them with `scripts/gpu_tests.sh --build DIR`
# on a machine with cargo (it installs nvcc from PyPI when needed), copy DIR next to a checkout
# of the same commit on the GPU machine, then run `scripts/gpu_tests.sh DIR` there. DIR also
# gets mla-bench, so it holds all that `scripts/gpu_run.sh` needs.
#
# Runs: the mla-cuda GPU test binaries (kernels vs the CPU reference, HF fixture parity, graphs,
# GEMV), the HF-fixture end-to-end test through the real server on --device cuda, and a
# concurrent-chat check of the V2-Lite shape with dummy weights over HTTP.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--build" ]]; then
  out="${2:?usage: scripts/gpu_tests.sh --build DIR}"
  export NVCC="$(scripts/install_nvcc.sh)" MLA_REQUIRE_NVCC=1
  cargo build --release --locked -p mla-serve -p mla-bench
  mkdir -p "$out"
  cargo test --release --locked -p mla-cuda --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"].startswith("gpu_"):
        print(m["executable"])' \
    | while read -r exe; do cp "$exe" "$out/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"; done
  cp "${CARGO_TARGET_DIR:-target}/release/mla-serve" "${CARGO_TARGET_DIR:-target}/release/mla-bench" "$out/"
  strip "$out"/*
  ls -la "$out"
  exit 0
fi

bins="${1:?usage: scripts/gpu_tests.sh BIN_DIR (or --build BIN_DIR)}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD"
status=0
for t in "$bins"/gpu_*; do
  echo "== $(basename "$t")"
  "$t" --ignored --test-threads 1 || status=1
done

echo "== HF fixtures through the server on the GPU"
# The test needs the openai package; wheels in .whl/ serve a GPU machine without a package index.
if compgen -G ".whl/*.whl" > /dev/null && ! python3 -c 'import openai' 2> /dev/null; then
  site="$(mktemp -d)"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl > /dev/null
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
MLA_E2E_DEVICE=cuda MLA_SERVE_BIN="$bins/mla-serve" python3 -m pytest -q tests/e2e/test_hf_fixtures.py || status=1

echo "== V2-Lite shape, dummy weights: concurrent chat over HTTP"
port=8123
"$bins/mla-serve" --model deepseek-v2-lite --load-format dummy --device cuda --tokenizer assets/demo \
  --port $port --max-num-seqs 64 --gpu-memory-utilization 0.5 > /tmp/mla-serve-gpu.log 2>&1 &
server=$!
for _ in $(seq 180); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
python3 scripts/gpu_http_check.py "http://127.0.0.1:$port" 48 || status=1
kill -INT $server; wait $server || status=1
grep -E "KV cache|device|CUDA graphs" /tmp/mla-serve-gpu.log | head -5
exit $status
