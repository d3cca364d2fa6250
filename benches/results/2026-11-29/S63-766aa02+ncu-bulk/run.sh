#!/usr/bin/env bash
# S62's server check again with the structured requests sent one prompt at a time (batch 1:
# exact W8A16 GEMVs in both servers, where S62's batched form ran W8A8 steps whose activation
# rounding moved logprobs by up to 1.2 between batch shapes), with the logprob spread printed;
# then ncu of the bulk-copy FP8 gate/up (MLA_MOE_GATE_UP_BULK=2) at B = 1 and 2, S58's sections,
# to say why it does not beat the five-block warp kernel (S61).
set -u
cd "$(dirname "$0")/../../../.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD" CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
export MLA_SERVE_STARTUP_S=300
b=/tmp/b; mkdir -p $b; xz -dc .device/s61/bins.tar.xz | tar -x -C $b
site=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="$site"
L=$(mktemp -d); nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 300 python3 scripts/gpu_shaped_and_forked_check.py --bin $b/mla-serve --out $L/shaped_forked.json > $L/shaped_forked.log 2>&1
echo "shaped/forked/structured check rc=$?"; grep -E 'FAIL|positions in all|drafted|checks passed|largest' $L/shaped_forked.log
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
TP8='"num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 2304, "moe_intermediate_size": 256, "vocab_size": 16160'
for batch in 1 2; do
  MLA_MOE_GATE_UP_BULK=2 timeout 150 $NCU --profile-from-start off --kernel-name regex:moe_gemv_gate_up --launch-skip 2 \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section LaunchStats $b/mla-bench profile --config configs/deepseek-v3.json \
    --hf-overrides "{$TP8, \"num_hidden_layers\": 6}" --batch $batch --context 1024 --prefill-len 0 > $L/ncu-b$batch.txt 2> $L/ncu-b$batch.err
  echo "B=$batch rc=$?"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slot|L2 Hit|Mem Busy|Max Bandwidth|Grid Size|Block Size|moe_gemv" $L/ncu-b$batch.txt | head -24
done
tar -C $L -czf $OUT/logs.tgz .
