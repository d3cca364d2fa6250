#!/usr/bin/env bash
# Serving-side H200 run 6 (issue 5), final: binaries from a clean checkout of $1 (the kernels
# helper's committed round included): GPU tests, the engine and serving rows.
set -o pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MLA_REPO_ROOT=$PWD MLA_GIT_COMMIT=$1
D=.device/serving
T0=$(date +%s)
stamp() { echo "== $1 (t+$(( $(date +%s) - T0 ))s, $(date -u +%FT%TZ))"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
stamp tests
for t in gpu_gemv gpu_graphs gpu_model; do timeout 150 $D/$t --ignored --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED" | sed "s/^/$t: /"; done
stamp engine
timeout 200 $D/mla-bench engine --decode 1x1024x256,64x4096x64,256x4096x64 --out $OUT/engine.json 2>&1 | grep -E "^(prefill|decode)"
stamp server
python3 crates/mla-bench/wide_tokenizer.py assets/demo /tmp/widetok 102400
$D/mla-serve --model deepseek-v2-lite --load-format dummy --device cuda --tokenizer /tmp/widetok --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --port 8011 > $OUT/server.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
stamp serve_c1
timeout 90 $D/mla-bench serve --base-url http://127.0.0.1:8011 --input-len 1024 --output-len 256 --num-prompts 12 --max-concurrency 1 --ignore-eos --gpu "NVIDIA H200" --out $OUT/serve_c1.json 2>&1 | grep -E "Output token|TTFT|ITL|Failed|failure"
stamp serve_c256
timeout 240 $D/mla-bench serve --base-url http://127.0.0.1:8011 --input-len 1024 --output-len 256 --num-prompts 1000 --max-concurrency 256 --ignore-eos --gpu "NVIDIA H200" --out $OUT/serve_c256.json 2>&1 | grep -E "throughput|TTFT|TPOT|ITL|Failed|failure|duration"
kill -INT $SP; wait $SP
grep -E "last [0-9]+ steps" $OUT/server.log | tail -4
stamp done
