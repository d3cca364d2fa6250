#!/usr/bin/env bash
# Serving-side H200 run 3 (issue 5), binaries from a clean checkout of $1: graph tests (with the
# recapture test) and parity tests; engine decode at B=16 and B=128 and serving at concurrency
# 16 and 64 to fill the throughput curves.
set -o pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MLA_REPO_ROOT=$PWD MLA_GIT_COMMIT=$1
D=.device/serving
T0=$(date +%s)
stamp() { echo "== $1 (t+$(( $(date +%s) - T0 ))s, $(date -u +%FT%TZ))"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
stamp gpu_graphs; timeout 120 $D/gpu_graphs --ignored --test-threads 1 --nocapture 2>&1 | grep -E "^test |test result|graph vs|captured again|panicked|FAILED|assert"
stamp gpu_model; timeout 150 $D/gpu_model --ignored --test-threads 1 2>&1 | grep -E "^test |test result|panicked|FAILED"
stamp engine
timeout 150 $D/mla-bench engine --prefill-reps 3 --decode 16x4096x64,128x4096x64 --out $OUT/engine_more.json 2>&1 | grep -E "^(prefill|decode)"
stamp server
python3 crates/mla-bench/wide_tokenizer.py assets/demo /tmp/widetok 102400
$D/mla-serve --model deepseek-v2-lite --load-format dummy --device cuda --tokenizer /tmp/widetok --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --port 8011 > $OUT/server.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
for c in 16 64; do
  stamp serve_c$c
  timeout 90 $D/mla-bench serve --base-url http://127.0.0.1:8011 --input-len 1024 --output-len 256 --num-prompts $((4 * c)) --max-concurrency $c --ignore-eos --gpu "NVIDIA H200" --out $OUT/serve_c$c.json 2>&1 | grep -E "Output token|Median (TTFT|ITL)|Failed|failure"
done
kill -INT $SP; wait $SP
grep -E "last [0-9]+ steps" $OUT/server.log | tail -4
stamp done
