#!/usr/bin/env bash
# Issue 29/31: the small-step MoE path up to 4 tokens (the default) against 8
# (MLA_MOE_GEMV_MAX_TOKENS=8), same binary, one H200: the FP8 MoE, model and MTP tests at 8;
# V2-Lite FP8 decode at B = 1, 4 and 8; one TP-8 rank of V3 (61 layers + MTP) in spec-step at
# B = 1, 4, 8 (plain decode, and K = 1 at acceptance 0.8, whose verify step has 2B rows).
set -u
cd "$(dirname "$0")/../../../.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD"
b=/tmp/b; mkdir -p $b; for f in .device/s35/*.xz; do xz -dc "$f" > $b/$(basename "$f" .xz); chmod +x $b/$(basename "$f" .xz); done
L=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for t in gpu_moe_fp8 gpu_model_fp8 gpu_mtp; do
  MLA_MOE_GEMV_MAX_TOKENS=8 timeout 200 $b/$t --ignored --test-threads 1 > $L/$t.log 2>&1; echo "$t (8 tokens) rc=$?"
  grep -E 'test result|panicked|FAILED' $L/$t.log | tail -3
done
TP8='{"num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 2304, "moe_intermediate_size": 256, "vocab_size": 16160}'
for rep in 1 2; do
for m in 4 8; do
  echo "== MLA_MOE_GEMV_MAX_TOKENS=$m (rep $rep)"
  MLA_MOE_GEMV_MAX_TOKENS=$m timeout 60 $b/mla-bench engine --config configs/deepseek-v2-lite.json --quantization fp8 \
    --decode 1x1024x128,4x1024x64,8x1024x64 --prefill-len 512 --prefill-reps 1 --out $L/v2lite-max$m-r$rep.json 2>&1 | grep -E '^decode'
  MLA_MOE_GEMV_MAX_TOKENS=$m timeout 100 $b/mla-bench spec-step --config configs/deepseek-v3.json --hf-overrides "$TP8" \
    --batch 1,4,8 --drafts 1 --acceptance 0.8 --context 1024 --out $L/spec-max$m-r$rep.json > $L/spec-max$m-r$rep.log 2>&1
  grep -E "^B=" $L/spec-max$m-r$rep.log
done
done
tar -C $L -czf $OUT/logs.tgz .
