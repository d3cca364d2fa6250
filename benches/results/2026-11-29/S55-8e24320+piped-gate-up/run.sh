#!/usr/bin/env bash
# Issue 29: a pipelined FP8 gate/up warp kernel for steps of 1-3 tokens (moe_gemv_gate_up_fp8_piped,
# MLA_MOE_GATE_UP_PIPED=1) and two kernel tidy-ups (moe_align's scans in one helper, the down
# kernels' combine in one helper), a working-tree build against 8e24320. gpu_moe, gpu_moe_fp8
# (the pipelined kernel's bits against the warp kernel's), gpu_model_fp8; ncu of the gate/up
# kernels at B = 1, 2, 3 (TP-8 rank of V3, 6 layers) with the knob 0 and 1; then, twice each,
# spec-step plain decode on a TP-8 rank of V3 (61 layers + MTP) and V2-Lite FP8 engine decode for
# 8e24320, the new binary, and the new binary with the pipelined kernel.
set -u
cd "$(dirname "$0")/../../../.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD" CUDA_VISIBLE_DEVICES=0
b=/tmp/b; mkdir -p $b; xz -dc .device/s55/bins.tar.xz | tar -x -C $b
L=$(mktemp -d); NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for t in gpu_moe gpu_moe_fp8 gpu_model_fp8; do
  timeout 200 $b/$t --ignored --test-threads 1 --nocapture > $L/$t.log 2>&1; echo "$t rc=$?: $(grep -E 'test result' $L/$t.log | tail -1)"
  grep -E 'panicked|FAILED' $L/$t.log | head -3
done
grep -E "Piped H=7168 I=256" $L/gpu_moe_fp8.log | head -4
TP8='"num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 2304, "moe_intermediate_size": 256, "vocab_size": 16160'
for piped in 0 1; do
  MLA_MOE_GATE_UP_PIPED=$piped timeout 100 $NCU --profile-from-start off --clock-control none --kernel-name regex:moe_gemv_gate_up \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw $b/mla-bench profile \
    --config configs/deepseek-v3.json --hf-overrides "{$TP8, \"num_hidden_layers\": 6}" \
    --batch 1,2,3 --context 1024 --prefill-len 0 > $L/ncu-$piped.csv 2> $L/ncu-$piped.err
  python3 - $L/ncu-$piped.csv $piped <<'PY'
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
rows = list(csv.reader(lines[next(i for i, l in enumerate(lines) if l.startswith('"ID"')):]))
h = rows[0]; ti, bi, ni = h.index("gpu__time_duration.sum"), h.index("dram__bytes_read.sum"), h.index("Kernel Name")
v = [(r[ni][:28], float(r[ti].replace(",", "")) / 1e3, float(r[bi].replace(",", "")) / 1e6) for r in rows[2:]]
n = len(v) // 3
out = []
for s, label in enumerate(["B1", "B2", "B3"]):
    part = v[n * s: n * s + n]
    t = sum(x for _, x, _ in part) / n; mb = sum(y for _, _, y in part) / n
    out.append(f"{label} {t:6.2f} us {mb:5.1f} MB {mb / t:4.2f} TB/s")
print(f"ncu gate/up piped={sys.argv[2]} ({v[0][0]}, {n} a batch): " + " | ".join(out))
PY
done
for rep in 1 2; do
  for v in old new piped; do
    bin=$b/mla-bench; e=MLA_MOE_GATE_UP_PIPED=0
    [[ $v == old ]] && bin=$b/mla-bench-8e24320; [[ $v == piped ]] && e=MLA_MOE_GATE_UP_PIPED=1
    env $e timeout 100 $bin spec-step --config configs/deepseek-v3.json --hf-overrides "{$TP8}" \
      --batch 1,2,3,4 --drafts 1 --acceptance 0.8 --context 1024 --out $L/spec-$v-$rep.json > $L/spec-$v-$rep.log 2>&1
    grep -E "plain decode" $L/spec-$v-$rep.log | sed "s/^/$v #$rep: /"
    env $e timeout 100 $bin engine --config configs/deepseek-v2-lite.json --quantization fp8 \
      --decode 1x1024x128,2x1024x64,4x1024x64 --prefill-len 512 --prefill-reps 1 \
      --out $L/v2lite-$v-$rep.json > $L/v2lite-$v-$rep.log 2>&1
    echo "v2-lite $v #$rep: $(grep -oE 'decode B=[0-9]+ ctx=1024: [0-9]+ tok/s' $L/v2lite-$v-$rep.log | tr '\n' ' ')"
  done
done
gzip $L/*.csv
tar -C $L -czf $OUT/logs.tgz .
