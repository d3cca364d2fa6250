#!/usr/bin/env bash
# MoE expert-GEMM round (issue 5) on one H200: binaries built from commit $1 (release, stripped) in
# .device/moe/. GPU tests (all kernel tests, graphs, model parity), the grouped-GEMM and prefill
# attention micro-benchmarks, and the engine's prefill (1 x 4096) and decode B=256 ctx 4096 rows.
set -o pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MLA_REPO_ROOT=$PWD MLA_GIT_COMMIT=$1
D=.device/moe
T0=$(date +%s)
stamp() { echo "== $1 (t+$(( $(date +%s) - T0 ))s, $(date -u +%FT%TZ))"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
stamp bench
timeout 120 $D/mla_cuda_bench --out $OUT/bench.json --only moe_experts,prefill_attention 2>&1 | grep -vE "^\s*$"
stamp gpu_kernels
timeout 200 $D/gpu_kernels --ignored --test-threads 4 --nocapture 2>&1 | grep -E "MoE|test result|panicked|FAILED|^test "
for t in gpu_graphs gpu_model; do stamp $t; timeout 200 $D/$t --ignored --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED" | sed "s/^/$t: /"; done
stamp engine
timeout 200 $D/mla-bench engine --decode 256x4096x64 --out $OUT/engine.json 2>&1 | grep -E "^(prefill|decode)"
stamp done
# One launch of the fused gate/up kernel at 4096 tokens (one block per item), for the time breakdown.
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 120 $NCU --clock-control none -k moe_grouped_gemm_silu_sm90 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy $D/mla_cuda_bench --only moe_experts --out /tmp/ncu-bench.json > $OUT/ncu.txt 2>&1; grep -E "Throughput|Duration|Busy|Hit Rate|Stall|Issue|Active Warps|Achieved" $OUT/ncu.txt | head -40
stamp ncu_done
