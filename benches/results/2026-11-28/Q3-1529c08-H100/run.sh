#!/usr/bin/env bash
# Device call 3 on one H100 (2026-11-27, issue 28): where a --tp 4 batch-1 step of DeepSeek-V2
# 236B with FP8 weights goes. One GPU runs one TP-4 rank's share of the model (32 of 128 heads,
# a quarter of every FFN width, all 160 experts: ModelConfig::local's dims) with no collective:
# the engine at batch 1 with and without CUDA graphs at full depth, then ncu's per-kernel time of
# one eager step at 6 and 3 layers (their difference: three MoE layers).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R=/tmp/res3; mkdir -p $R /tmp/b
tar -C /tmp/b -xJf .device/bins.tar.xz || exit 1
B=/tmp/b/bins NCU=/usr/local/cuda/bin/ncu
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $R/gpus.txt
RANK='"num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 3072, "moe_intermediate_size": 384'
E="$B/mla-bench engine --config configs/deepseek-v2.json --quantization fp8 --gpu-memory-utilization 0.9 --max-num-seqs 64 --max-num-batched-tokens 2048 --max-model-len 4096 --prefill-len 1024 --prefill-reps 1 --decode 1x1024x64"
timeout 150 $E --hf-overrides "{$RANK}" --out $R/rank-b1.json > $R/rank-b1.txt 2>&1
timeout 150 $E --hf-overrides "{$RANK}" --no-cuda-graphs --out $R/rank-b1-eager.json > $R/rank-b1-eager.txt 2>&1
for L in 6 3; do
  timeout 150 $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    $B/mla-bench profile --config configs/deepseek-v2.json --quantization fp8 --hf-overrides "{$RANK, \"num_hidden_layers\": $L}" \
    --batch 1 --context 1024 --prefill-len 0 > $R/ncu-L$L.csv 2> $R/ncu-L$L.err
done
tar -C /tmp -czf $OUT/res3.tgz res3
grep -h -E "tok/s" $R/rank-b1*.txt
wc -l $R/ncu-L*.csv; tail -3 $R/ncu-L6.err
