#!/usr/bin/env bash
# Device call 2 on four GPUs (2026-11-27, issue 28), binaries with mixed steps and the bf16
# packed reduce as defaults: the mixed stages on four GPUs (dpa: turns, mixed, mixed-f32,
# mixed-2k; replicas: turns, mixed), the HF fixtures through the server under --tp 4 and DP
# attention (mixed steps by default), gpu_mixed_step, then DeepSeek-V2 236B with FP8 weights
# under --tp 4 at batch 1: the engine with and without CUDA graphs, and under nsys when present.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R=/tmp/res2; mkdir -p $R /tmp/b
tar -C /tmp/b -xJf .device/bins.tar.xz || exit 1
B=/tmp/b/bins C=$(cat .device/commit)
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $R/gpus.txt
MLA_REPO_ROOT=$PWD timeout 60 $B/gpu_mixed_step --ignored --test-threads 1 --nocapture > $R/gpu_mixed_step.txt 2>&1
timeout 300 scripts/gpu_multi_run.sh --gpus 4 --bins $B --out $R/m4 --commit $C mixed-dpa mixed-replicas hf-dpa hf-tp > $R/lane-m4.txt 2>&1
V2="$B/mla-bench engine --config configs/deepseek-v2.json --quantization fp8 --tp 4 --gpu-memory-utilization 0.9 --max-num-seqs 64 --max-num-batched-tokens 2048 --max-model-len 4096 --prefill-len 1024 --prefill-reps 1 --decode 1x1024x64"
timeout 150 $V2 --out $R/v2-tp4-b1.json > $R/v2-tp4-b1.txt 2>&1
timeout 150 $V2 --no-cuda-graphs --out $R/v2-tp4-b1-eager.json > $R/v2-tp4-b1-eager.txt 2>&1
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}" > $R/nsys.txt
if [[ -n "$NSYS" ]]; then
  timeout 200 $NSYS profile -o $R/v2tp4 --force-overwrite true --trace=cuda --cuda-graph-trace=node $V2 --out $R/v2-tp4-b1-nsys.json >> $R/nsys.txt 2>&1
  timeout 60 $NSYS stats --report cuda_gpu_kern_sum --format csv --output $R/v2tp4 $R/v2tp4.nsys-rep >> $R/nsys.txt 2>&1
  rm -f $R/v2tp4.sqlite
fi
tar -C /tmp -czf $OUT/res2.tgz res2
grep -E "test result|error|contrast" $R/gpu_mixed_step.txt | tail -12
grep -E "completed|FAIL|passed|failed" $R/lane-m4.txt | tail -20
grep -h -E "tok/s|step" $R/v2-tp4-b1*.txt | tail -12
tail -5 $R/nsys.txt
