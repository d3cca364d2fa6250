#!/usr/bin/env bash
# Device call 1 on four GPUs (2026-11-27, issue 28): mixed steps and the bf16 packed reduce on
# two GPUs. Lane A (GPUs 0-1): mixed-dpa (turns, mixed, mixed-bf16, mixed-2k), then the
# collectives bench. Lane B (GPUs 2-3): mixed-replicas (turns, mixed), then the HF fixtures
# under DP attention with mixed steps, f32 and bf16 reduce. Lane C (GPU 3 after B, GPU 2
# gpu_mixed_step first): the GPU tests. A watchdog packs the results at 570 s.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R /tmp/b
tar -C /tmp/b -xJf .device/bins.tar.xz || exit 1
B=/tmp/b/bins C=$(cat .device/commit)
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $R/gpus.txt
( sleep 565; tar -C /tmp -czf $OUT/res1.tgz res ) &
wd=$!
( CUDA_VISIBLE_DEVICES=0,1 timeout 420 scripts/gpu_multi_run.sh --gpus 2 --bins $B --out $R/m2 --commit $C mixed-dpa
  CUDA_VISIBLE_DEVICES=0,1 timeout 100 scripts/gpu_multi_run.sh --gpus 2 --bins $B --out $R/c2 --commit $C collectives
) > $R/laneA.txt 2>&1 &
pa=$!
( CUDA_VISIBLE_DEVICES=2 MLA_REPO_ROOT=$PWD LD_LIBRARY_PATH=/usr/local/cuda/lib64 timeout 200 $B/gpu_mixed_step --ignored --test-threads 1 --nocapture > $R/gpu_mixed_step.txt 2>&1 ) &
pm=$!
( CUDA_VISIBLE_DEVICES=2,3 MLA_RUN_PORT=8032 timeout 230 scripts/gpu_multi_run.sh --gpus 2 --bins $B --out $R/r2 --commit $C mixed-replicas
  wait $pm
  CUDA_VISIBLE_DEVICES=2,3 MLA_RUN_PORT=8032 MLA_HF_FLAGS=--enable-mixed-chunk timeout 100 scripts/gpu_multi_run.sh --gpus 2 --bins $B --out $R/hf-mixed --commit $C hf-dpa
  CUDA_VISIBLE_DEVICES=2,3 MLA_RUN_PORT=8032 MLA_HF_FLAGS=--enable-mixed-chunk MLA_DPA_PACKED_REDUCE=bf16 timeout 100 scripts/gpu_multi_run.sh --gpus 2 --bins $B --out $R/hf-mixed-bf16 --commit $C hf-dpa
) > $R/laneB.txt 2>&1 &
pb=$!
wait $pb
( CUDA_VISIBLE_DEVICES=3 MLA_E2E_PORT=8125 timeout 200 scripts/gpu_tests.sh $B ) > $R/gpu-tests.txt 2>&1 &
wait $pa
wait
kill $wd 2>/dev/null
tar -C /tmp -czf $OUT/res1.tgz res
grep -h -E "completed|FAIL|passed|failed" $R/laneA.txt $R/laneB.txt | tail -30
grep -E "test result|rel|contrast|panicked" $R/gpu_mixed_step.txt | tail -20
grep -E "^== |test result" $R/gpu-tests.txt | tail -40
