#!/usr/bin/env bash
# Issue 31 under --tp 2 and issue 29's streaming GEMV in the engine; the whole GPU suite.
set -u
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD" NCCL_NVLS_ENABLE=0
export MLA_GIT_COMMIT="$(cat .device/run3/commit)"
b=/tmp/b; mkdir -p $b; for f in .device/run3/*.xz; do xz -dc "$f" > $b/$(basename "$f" .xz); chmod +x $b/$(basename "$f" .xz); done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
echo "== gpu_mtp"; timeout 150 $b/gpu_mtp --ignored --test-threads 1 --nocapture 2>&1 | grep -v '^note\|^stack' | grep -E 'test |result|TP ranks|drafts|panicked|left|right' | tail -30
echo "== engine, V2-Lite fp8: streaming GEMV against the base binary (MMA/FMA GEMV)"
for bin in mla-bench mla-bench-base; do
  timeout 90 $b/$bin engine --config configs/deepseek-v2-lite.json --quantization fp8 --decode 1x1024x128,8x1024x64 \
    --prefill-len 4096 --prefill-reps 1 --out $OUT/engine-v2lite-fp8-$bin.json 2>&1 | grep -E 'decode|tok/s' | tail -4
done
if [ "$mem" -gt 120000 ]; then
  echo "== spec-step, a TP-8 rank of V3, streaming GEMV"
  timeout 100 $b/mla-bench spec-step --config configs/deepseek-v3.json \
    --hf-overrides '{"num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 2304, "moe_intermediate_size": 256, "vocab_size": 16160}' \
    --batch 1,4,32 --drafts 1,2 --acceptance 0,0.8 --context 1024 --out $OUT/spec_step_tp8rank.json 2>&1 | tail -14
fi
echo "== server: MTP under --tp 2, dummy V3 shape (4 layers), concurrent chat"
port=8125
$b/mla-serve --model deepseek-v3 --hf-overrides '{"num_hidden_layers": 4}' --load-format dummy --device cuda --tokenizer assets/demo \
  --served-model-name deepseek-v2-lite --port $port --max-num-seqs 64 --gpu-memory-utilization 0.5 --tp 2 \
  --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}' > $OUT/serve_mtp_tp2.log 2>&1 &
server=$!
for _ in $(seq 150); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
timeout 90 python3 scripts/gpu_http_check.py "http://127.0.0.1:$port" 48 | head -3; echo "http check rc=${PIPESTATUS[0]}"
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^mla:spec_decode_num_draft' | head -3
kill -INT $server; wait $server; echo "server rc=$?"
grep -E "speculative|rank|ERROR" $OUT/serve_mtp_tp2.log | head -6
echo "== GPU tests of the touched paths (the GEMV kernel in the model, graphs, mixed steps)"
for t in gpu_gemv_fp8 gpu_model_fp8 gpu_mixed_step gpu_graphs; do
  echo "== $t"; timeout 120 $b/$t --ignored --test-threads 1 2>&1 | grep -E 'test |test result|panicked' | tail -12
done
