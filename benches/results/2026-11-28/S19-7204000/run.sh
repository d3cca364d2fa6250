#!/usr/bin/env bash
# Issue 31 / the sampler: top-p's passes sum float exps in float per thread (double across
# the block), after S18 showed 16-byte loads did not change a pass's 23 us: the float-to-double
# conversion and double add per token go. Tests, spec-step and the top-p server as S18.
# All logs go into one tarball (only a few files come back per call).
set -u
cd "$(dirname "$0")/../../../.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
b=/tmp/b; mkdir -p $b; for f in .device/s6/*.xz; do xz -dc "$f" > $b/$(basename "$f" .xz); chmod +x $b/$(basename "$f" .xz); done
site=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="$site"
L=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for t in gpu_sampling gpu_constrained; do
  timeout 100 $b/$t --ignored --test-threads 1 > $L/$t.log 2>&1; echo "$t rc=$?"
  grep -E 'test result|panicked' $L/$t.log | tail -3
done
timeout 200 $b/gpu_mtp --ignored --test-threads 1 --nocapture > $L/gpu_mtp.log 2>&1; echo "gpu_mtp rc=$?"
grep -E '^test |test result|chi-square|stood|panicked' $L/gpu_mtp.log | tail -16
for s in "0 1" "1 1" "0.8 0.9"; do
  set -- $s
  timeout 100 $b/mla-bench spec-step --config configs/deepseek-v3.json --hf-overrides '{"num_hidden_layers": 4}' \
    --quantization fp8 --batch 1,16,64,128 --drafts 1,2 --acceptance 0,0.8 --temperature $1 --top-p $2 \
    --out $L/spec_step_t$1_p$2.json > $L/spec_step_t$1_p$2.log 2>&1
  echo "spec-step temperature $1 top-p $2: rc=$?"; grep -E "plain decode|acceptance 0.80" $L/spec_step_t$1_p$2.log
done
port=8141
for mode in mtp plain; do
  extra=(); [[ $mode == mtp ]] && extra=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}')
  $b/mla-serve --model deepseek-v3 --hf-overrides '{"num_hidden_layers": 4}' --load-format dummy --device cuda \
    --tokenizer assets/demo --served-model-name deepseek-v2-lite --port $port --max-num-seqs 128 --gpu-memory-utilization 0.8 \
    "${extra[@]}" > $L/serve_$mode.log 2>&1 &
  server=$!
  for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  for c in 64 1; do
    n=$((c == 1 ? 16 : 384))
    timeout 60 $b/mla-bench serve --base-url "http://127.0.0.1:$port" --backend openai --tokenizer assets/demo \
      --num-prompts $n --max-concurrency $c --random-input-len 128 --random-output-len 128 --temperature 0.8 --top-p 0.9 \
      --save-result --result-dir $L --result-filename "${mode}_c${c}_p0.9.json" > "$L/${mode}_c${c}_p0.9.log" 2>&1
    echo "$mode, $c streams, temperature 0.8 top-p 0.9: rc=$?"; grep -E "Successful requests|Output token throughput|Mean TPOT" "$L/${mode}_c${c}_p0.9.log"
  done
  kill -INT $server; wait $server; echo "server rc=$?"; grep -c "WARN.*backend step" $L/serve_$mode.log
done
tar -C $L -czf $OUT/logs.tgz .
