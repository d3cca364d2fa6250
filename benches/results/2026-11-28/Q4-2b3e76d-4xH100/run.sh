#!/usr/bin/env bash
# Device call 4 on four GPUs (2026-11-27, issue 28): DeepSeek-V2 236B with FP8 weights and the
# FP8 latent cache, --tp 4 against DP attention, 1024-in / 1024-out at concurrency 256 (mixed
# steps and the bf16 packed reduce by default).
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/res4; mkdir -p $R /tmp/b
tar -C /tmp/b -xJf .device/bins.tar.xz || exit 1
B=/tmp/b/bins C=$(cat .device/commit)
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $R/gpus.txt
MLA_BIG_CONCURRENCY=256 MLA_BIG_FLAGS="--kv-cache-dtype fp8" MLA_RUN_TIMEOUT_BIG_V2_TP_C256=260 \
  timeout 560 scripts/gpu_multi_run.sh --gpus 4 --bins $B --out $R/big --commit $C big-v2 > $R/big.txt 2>&1
tar -C /tmp -czf $OUT/res4.tgz res4
grep -E "completed|KV cache:|steps:|FAIL" $R/big.txt | cut -c1-200
