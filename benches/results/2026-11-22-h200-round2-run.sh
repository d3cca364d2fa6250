#!/usr/bin/env bash
# Second-round H200 run of issue 5 (PDL, small-batch MoE, warp-specialised GEMM and prefill
# attention, pipelined engine): every row of performance.md's table from one run of one commit
# ($1) with the binaries in $2 (built here with `scripts/gpu_tests.sh --build $2` plus mla-bench
# and the mla_cuda_bench bench binary, release, stripped), an engine A/B without programmatic
# dependent launch, then the GPU tests of the same binaries. The openai wheels for the e2e test in
# .whl. Writes kernels.json, engine.json, engine_nopdl.json, serve_c1.json, serve_c256.json,
# server.log and gpu_tests.log under $OUT.
set -o pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MLA_REPO_ROOT=$PWD MLA_GIT_COMMIT=$1
D=${2:?binary dir}
T0=$(date +%s)
stamp() { echo "== $1 (t+$(( $(date +%s) - T0 ))s, $(date -u +%FT%TZ))"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
stamp kernels
timeout 120 $D/mla-bench kernels --bench-bin $D/mla_cuda_bench --only decode_attention,prefill_attention,moe_experts --out $OUT/kernels.json 2>&1 | grep -vE "^\s*$"
stamp engine
timeout 240 $D/mla-bench engine --decode 1x1024x256,16x4096x64,64x4096x64,128x4096x64,256x4096x64 --out $OUT/engine.json 2>&1 | grep -E "^(prefill|decode)"
stamp engine_nopdl
MLA_DISABLE_PDL=1 timeout 120 $D/mla-bench engine --decode 1x1024x256,256x4096x64 --out $OUT/engine_nopdl.json 2>&1 | grep -E "^(prefill|decode)"
stamp server
python3 crates/mla-bench/wide_tokenizer.py assets/demo /tmp/widetok 102400
$D/mla-serve --model deepseek-v2-lite --load-format dummy --device cuda --tokenizer /tmp/widetok --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --port 8011 > $OUT/server.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
stamp serve_c1
timeout 90 $D/mla-bench serve --base-url http://127.0.0.1:8011 --input-len 1024 --output-len 256 --num-prompts 12 --max-concurrency 1 --ignore-eos --gpu "NVIDIA H200" --out $OUT/serve_c1.json 2>&1 | grep -E "Output token|TTFT|ITL|Failed|failure"
grep -E "last [0-9]+ steps" $OUT/server.log | tail -1
stamp serve_c256
timeout 240 $D/mla-bench serve --base-url http://127.0.0.1:8011 --input-len 1024 --output-len 256 --num-prompts 1000 --max-concurrency 256 --ignore-eos --gpu "NVIDIA H200" --out $OUT/serve_c256.json 2>&1 | grep -E "throughput|TTFT|TPOT|ITL|Failed|failure|duration"
kill -INT $SP; wait $SP
grep -E "last [0-9]+ steps" $OUT/server.log | tail -2
stamp tests
timeout 240 scripts/gpu_tests.sh $D > $OUT/gpu_tests.log 2>&1; echo "gpu_tests.sh exit: $?"
grep -E "^== |test result|panicked|FAILED|passed|failed|KV cache|graphs|requests" $OUT/gpu_tests.log
stamp done
