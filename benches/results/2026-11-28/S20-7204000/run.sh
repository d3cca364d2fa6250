#!/usr/bin/env bash
# The sampler's top-p cost at batch 1: where a pass's ~19 us go. ncu on sample_tokens in the
# plain decode graph of spec-step (V3 shape, 4 layers, FP8, dummy weights, B=1, temperature 0.8,
# top-p 0.9), binary of 7204000; then spec-step with the same binary and with one whose sampler
# and verdict kernels run 1024 threads per row instead of 512 (built from 7204000 with the four
# launch sizes changed, not committed), to see whether more warps per SM hide the passes'
# latency.
set -u
cd "$(dirname "$0")/../../../.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD"
b=/tmp/b; mkdir -p $b; for f in .device/s7/*.xz; do xz -dc "$f" > $b/$(basename "$f" .xz); chmod +x $b/$(basename "$f" .xz); done
L=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
args=(spec-step --config configs/deepseek-v3.json --hf-overrides '{"num_hidden_layers": 4}' --quantization fp8 --drafts 1 --acceptance 0 --temperature 0.8 --top-p 0.9)
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu); $NCU --version | tail -1
timeout 240 $NCU --graph-profiling node --kernel-name sample_tokens --launch-skip 2 --launch-count 3 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  $b/mla-bench "${args[@]}" --batch 1 > $L/ncu_sample_tokens.txt 2> $L/ncu.err
echo "ncu rc=$?"
grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Active Warps Per|Eligible Warps|Compute \(SM\) Throughput|Memory Throughput|Stall" $L/ncu_sample_tokens.txt | head -40
for v in mla-bench mla-bench-1024; do
  for s in "1 1" "0.8 0.9"; do
    set -- $s
    timeout 80 $b/$v "${args[@]:0:7}" --acceptance 0.8 --drafts 1,2 --batch 1,16,64,128 --temperature $1 --top-p $2 \
      --out $L/${v}_t$1_p$2.json > $L/${v}_t$1_p$2.log 2>&1
    echo "$v temperature $1 top-p $2: rc=$?"; grep -E "plain decode|acceptance 0.80" $L/${v}_t$1_p$2.log
  done
done
tar -C $L -czf $OUT/logs.tgz .
