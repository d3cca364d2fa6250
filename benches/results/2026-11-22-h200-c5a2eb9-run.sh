#!/usr/bin/env bash
# Serving-side H200 run 5 (issue 5), binaries from a clean checkout of $1: the small-batch GEMV
# kernel (test against f64 and cuBLAS, parity tests with it on), engine decode at B=1 and B=4 with
# and without it, serving at concurrency 1 (ITL), ncu of one B=1 decode step with it.
set -o pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MLA_REPO_ROOT=$PWD MLA_GIT_COMMIT=$1
D=.device/serving
T0=$(date +%s)
stamp() { echo "== $1 (t+$(( $(date +%s) - T0 ))s, $(date -u +%FT%TZ))"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
stamp gpu_gemv; timeout 60 $D/gpu_gemv --ignored --nocapture 2>&1 | grep -E "^test |test result|x 1:|panicked|FAILED"
stamp gpu_graphs; timeout 120 $D/gpu_graphs --ignored --test-threads 1 --nocapture 2>&1 | grep -E "^test |test result|graph vs|panicked|FAILED"
stamp gpu_model; timeout 150 $D/gpu_model --ignored --test-threads 1 2>&1 | grep -E "^test |test result|panicked|FAILED"
stamp engine_gemv
timeout 120 $D/mla-bench engine --prefill-reps 1 --decode 1x1024x256,4x1024x128 --out $OUT/engine_gemv.json 2>&1 | grep -E "^(prefill|decode)"
stamp engine_cublas
timeout 120 $D/mla-bench engine --no-gemv --prefill-reps 1 --decode 1x1024x256,4x1024x128 --out $OUT/engine_cublas.json 2>&1 | grep -E "^(prefill|decode)"
stamp server
python3 crates/mla-bench/wide_tokenizer.py assets/demo /tmp/widetok 102400
$D/mla-serve --model deepseek-v2-lite --load-format dummy --device cuda --tokenizer /tmp/widetok --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --port 8011 > $OUT/server.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
stamp serve_c1
timeout 90 $D/mla-bench serve --base-url http://127.0.0.1:8011 --input-len 1024 --output-len 256 --num-prompts 12 --max-concurrency 1 --ignore-eos --gpu "NVIDIA H200" --out $OUT/serve_c1.json 2>&1 | grep -E "throughput|TTFT|TPOT|ITL|requests|failure"
kill -INT $SP; wait $SP
grep -E "last [0-9]+ steps" $OUT/server.log | tail -2
stamp ncu
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 100 $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv --page raw $D/mla-bench profile --batch 1 --context 4096 --prefill-len 256 > $OUT/ncu_b1.csv 2>$OUT/ncu_err.log; echo "ncu rc $?"
python3 crates/mla-bench/ncu_breakdown.py $OUT/ncu_b1.csv "decode B=1 ctx 4096 (eager, GEMV)" "prefill 256" | grep -E "^##|^\| [a-zA-Z]" | head -12
stamp done
