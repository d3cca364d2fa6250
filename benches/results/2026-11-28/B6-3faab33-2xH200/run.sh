#!/usr/bin/env bash
# Issue 29: where the streaming FP8 GEMV pays in the engine, by weight size (A/B in one call).
set -u
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD"
export MLA_GIT_COMMIT="$(cat .device/run4/commit)+stream-min-bytes"
b=/tmp/b4; mkdir -p $b; xz -dc .device/run4/mla-bench.xz > $b/mla-bench; chmod +x $b/mla-bench
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
for rep in 1 2; do
for t in 1073741824 0 2097152 8388608; do
  echo "== V2-Lite fp8, MLA_GEMV_STREAM_MIN_BYTES=$t (rep $rep)"
  MLA_GEMV_STREAM_MIN_BYTES=$t timeout 60 $b/mla-bench engine --config configs/deepseek-v2-lite.json --quantization fp8 \
    --decode 1x1024x128,8x1024x64 --prefill-len 512 --prefill-reps 1 --out $OUT/v2lite-min$t-r$rep.json 2>&1 | grep -E '^decode'
done
done
for t in 1073741824 0 8388608; do
  echo "== V3 TP-8 rank (61 layers), MLA_GEMV_STREAM_MIN_BYTES=$t"
  MLA_GEMV_STREAM_MIN_BYTES=$t timeout 90 $b/mla-bench engine --config configs/deepseek-v3.json \
    --hf-overrides '{"num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 2304, "moe_intermediate_size": 256, "vocab_size": 16160}' \
    --max-model-len 4096 --max-num-seqs 16 --decode 1x1024x64,8x1024x32 --prefill-len 512 --prefill-reps 1 --out $OUT/v3rank-min$t.json 2>&1 | grep -E '^decode'
done
