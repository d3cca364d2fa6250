#!/usr/bin/env bash
# Issue 29: where the five-block FP8 gate/up (63086be's default at batch 1 on a TP-8 rank of V3)
# still loses to the copy bandwidth: ncu's speed-of-light, occupancy, warp-state and memory
# sections for one launch at B = 1 and one at B = 2 (6 layers), S57's binary.
set -u
cd "$(dirname "$0")/../../../.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD" CUDA_VISIBLE_DEVICES=0
b=/tmp/b; mkdir -p $b; xz -dc .device/s57/bins.tar.xz | tar -x -C $b mla-bench
L=$(mktemp -d); NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TP8='"num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 2304, "moe_intermediate_size": 256, "vocab_size": 16160'
for batch in 1 2; do
  timeout 200 $NCU --profile-from-start off --kernel-name regex:moe_gemv_gate_up --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section LaunchStats $b/mla-bench profile --config configs/deepseek-v3.json \
    --hf-overrides "{$TP8, \"num_hidden_layers\": 6}" --batch $batch --context 1024 --prefill-len 0 > $L/ncu-b$batch.txt 2> $L/ncu-b$batch.err
  echo "B=$batch rc=$?"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issue Slot|L2 Hit|Mem Busy|Max Bandwidth|Waves Per SM|Grid Size|moe_gemv" $L/ncu-b$batch.txt | head -40
done
tar -C $L -czf $OUT/logs.tgz .
