#!/usr/bin/env bash
# Serving-side H200 run 2 (issue 5), binaries built from a clean checkout of $1: engine bench
# (graphs, eager), HTTP serving at concurrency 1 and 256 with a tokenizer covering the whole
# vocabulary, ncu breakdown of an eager B=256 ctx-4096 decode step and a 4096-token prefill.
set -o pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MLA_REPO_ROOT=$PWD MLA_GIT_COMMIT=$1
D=.device/serving
T0=$(date +%s)
stamp() { echo "== $1 (t+$(( $(date +%s) - T0 ))s, $(date -u +%FT%TZ))"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
stamp engine_graphs
timeout 200 $D/mla-bench engine --decode 1x1024x256,64x4096x64,256x4096x64 --out $OUT/engine.json 2>&1 | grep -E "^(prefill|decode)|CUDA graphs"
stamp engine_eager
timeout 120 $D/mla-bench engine --no-cuda-graphs --prefill-reps 3 --decode 1x1024x128,64x4096x32 --out $OUT/engine_eager.json 2>&1 | grep -E "^(prefill|decode)"
stamp server
python3 crates/mla-bench/wide_tokenizer.py assets/demo /tmp/widetok 102400
$D/mla-serve --model deepseek-v2-lite --load-format dummy --device cuda --tokenizer /tmp/widetok --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --port 8011 > $OUT/server.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
stamp serve_c1
timeout 90 $D/mla-bench serve --base-url http://127.0.0.1:8011 --input-len 1024 --output-len 256 --num-prompts 12 --max-concurrency 1 --ignore-eos --gpu "NVIDIA H200" --out $OUT/serve_c1.json 2>&1 | grep -E "throughput|TTFT|TPOT|ITL|requests|failure"
stamp serve_c256
timeout 240 $D/mla-bench serve --base-url http://127.0.0.1:8011 --input-len 1024 --output-len 256 --num-prompts 1000 --max-concurrency 256 --ignore-eos --gpu "NVIDIA H200" --out $OUT/serve_c256.json 2>&1 | grep -E "throughput|TTFT|TPOT|ITL|requests|failure|duration"
kill -INT $SP; wait $SP
grep -E "last [0-9]+ steps|CUDA graphs" $OUT/server.log | tail -8
stamp ncu_profile
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 150 $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv --page raw $D/mla-bench profile --batch 256 --context 4096 --prefill-len 4096 > $OUT/ncu_profile.csv 2>$OUT/ncu_err.log; echo "ncu rc $?"; grep -E "eager" $OUT/ncu_err.log
python3 crates/mla-bench/ncu_breakdown.py $OUT/ncu_profile.csv "decode B=256 ctx 4096 (eager)" "prefill 4096 tokens (eager)" | grep -E "^##|^\| [a-zA-Z]" | head -30
stamp plot
python3 scripts/plot_performance.py --engine $OUT/engine.json $OUT/engine_eager.json --serve $OUT/serve_c1.json $OUT/serve_c256.json --out $OUT/performance.png 2>&1 | tail -3
stamp done
