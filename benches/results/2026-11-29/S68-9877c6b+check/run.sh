#!/usr/bin/env bash
# S67's server check again with its MTP server drafting every step (--speculative-load-rule off):
# under the default measured rule the fixture's untrained drafts stopped drafting after 16 and 4
# drafts (S67), which left the check's speculative half nearly untested. Same binaries as S67.
set -u
cd "$(dirname "$0")/../../../.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD" CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
export MLA_SERVE_STARTUP_S=300
b=/tmp/b; mkdir -p $b; xz -dc .device/s67/bins.tar.xz | tar -x -C $b
site=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="$site"
L=$(mktemp -d); nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 scripts/gpu_shaped_and_forked_check.py --bin $b/mla-serve --out $L/shaped_forked.json > $L/shaped_forked.log 2>&1
echo "shaped/forked/structured check rc=$?"; grep -E 'FAIL|positions in all|drafted|checks passed|largest' $L/shaped_forked.log
tar -C $L -czf $OUT/logs.tgz .
