#!/usr/bin/env bash
# Decode attention with four QK^T accumulator chains (issue 5) vs the kernel round's one chain,
# binaries of commit $1 in .device/final: both kernels' micro-benchmark, then the decode test
# (both kernels, poisoned outputs, contexts 1..9000, scattered block tables) with every other
# kernel test, and the graph and model parity tests.
set -o pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MLA_REPO_ROOT=$PWD MLA_GIT_COMMIT=$1
D=.device/final
T0=$(date +%s)
stamp() { echo "== $1 (t+$(( $(date +%s) - T0 ))s, $(date -u +%FT%TZ))"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
stamp bench
timeout 120 $D/mla_cuda_bench --out $OUT/bench.json --only decode_attention 2>&1 | grep -vE "^\s*$"
stamp gpu_kernels
timeout 200 $D/gpu_kernels --ignored --test-threads 4 --nocapture 2>&1 | grep -E "^decode|test result|panicked|FAILED"
for t in gpu_graphs gpu_model; do stamp $t; timeout 200 $D/$t --ignored --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED" | sed "s/^/$t: /"; done
stamp done
