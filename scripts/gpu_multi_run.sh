#!/usr/bin/env bash
# Correctness checks and benchmarks of every multi-GPU mode on one machine with N GPUs, from
# binaries built elsewhere (`scripts/gpu_tests.sh --build DIR`), in named stages:
#
#   scripts/gpu_multi_run.sh --gpus N --bins DIR --out DIR [--commit SHA] [--dry-run] STAGE...
#
# Modes: single (one GPU, the baseline), replicas (--dp N), tp (--tp N), dpa (--tp N
# --enable-dp-attention). Stages, run in the order given; each leaves STAGE.log (and JSON where
# it says) under --out:
#   group-tests   gpu_group: one-rank NCCL groups bit-equal to one GPU; TP and DP attention
#                 over 2..N ranks against one GPU (real_dims fixture)
#   hf-MODE       HF-fixture greedy outputs through the real server in MODE (real_dims, bf16)
#   nodes-MODE    the same over N processes of one GPU each (--nnodes N on one host): the
#                 multi-node path; MODE tp or dpa
#   chat-MODE     V2-Lite shape, dummy weights: 48 concurrent chats over HTTP, /metrics ranks
#   kill-rank     DP attention with rank 1 killed at its 40th step (MLA_TEST_KILL_RANK): every
#                 request answered, the server exits non-zero within 60 s
#   engine-MODE   mla-bench engine (V2-Lite, dummy weights): prefill and decode at 256 sequences
#                 per GPU, ctx 4k                                           engine-MODE.json
#   serve-MODE    mla-bench serve at concurrency 256 per GPU                serve-MODE.json
#   collectives   mla-bench collectives: NCCL all-reduce, all-gather, reduce-scatter (and the
#                 packed -v forms) at 1..8192 rows per rank, eager and from graphs  collectives.json
#   idle-ranks    DP attention, one streamed request at a time with random lengths for
#                 MLA_IDLE_SECONDS (600), then bursts: no failure, no token gap over 10x the
#                 median (scripts/idle_ranks.py)                          idle-ranks.json
#   soak          DP attention, mixed traffic with client aborts at concurrency 256 per GPU for
#                 MLA_SOAK_SECONDS (1800): no failure, back to idle, memory flat
#                 (scripts/soak.py)                                        soak.json
#   matrix        the deployment matrix at default flags: V2-Lite shape, dummy weights, bf16 and
#                 --quantization fp8 in every mode (replicas, tp, dpa); each serves 1024-in /
#                 128-out at concurrency 128 and 512 (MLA_MATRIX_PROMPTS: 256,512 prompts) with
#                 no failed request, then teacher-forced logprobs of 16 prompts; FP8 against
#                 bf16 in each mode, whose noise must agree within 1.5x    matrix-tf.log
#   big-MODEL     a large model with FP8 weights at default flags in tp and dpa: MODEL v2 (236B,
#                 full depth) or v3 (MLA_V3_LAYERS layers, 16); serves 1024-in / MLA_BIG_OUTPUT
#                 (1024) out at concurrency 1, 64 and 256; MLA_BIG_MODES picks the modes (tp dpa),
#                 MLA_BIG_FLAGS adds server flags (e.g. --kv-cache-dtype fp8), MLA_BIG_CONCURRENCY
#                 picks the concurrencies (1 64 256)                   big-MODEL-MODE-cN.json
#   router        prefix-aware routing against least-loaded (--router-policy), V2-Lite shape,
#                 dummy weights, in replicas and dpa: multi-turn (64 conversations x 8 turns of
#                 512 tokens, 128 out, c=64, MLA_ROUTER_TURN_DELAY: 2 s of a user's reading and
#                 typing between turns), shared prefix (MLA_ROUTER_SHARED_PROMPTS: 1000
#                 prompts, one 2000-token prefix, 200-token suffixes, c=64) and random
#                 (MLA_ROUTER_RANDOM_PROMPTS: 1024, 1024-in / 256-out, c=256); multi-turn on
#                 one GPU too. scripts/router_compare.py checks the issue's bar: hit rate within
#                 10% of one GPU's, turn-8 TTFT p50 at least 2x better, output throughput and
#                 random prompts not lower                    router-MODE-POLICY-BENCH.json,
#                                                                          router-summary.json
#   kvfp8-MODE    the FP8 latent cache against bf16 in MODE: V2-Lite shape, dummy weights, at
#                 --gpu-memory-utilization MLA_KVFP8_UTIL (0.5: the bf16 cache holds about half
#                 of 256 sequences of 1024 + 256 tokens per GPU) both serve 1024-in / 256-out at
#                 concurrency 256 per GPU (2x that many prompts); the startup logs' KV cache lines
#                 go to kvfp8-MODE.log                           kvfp8-MODE-{auto,fp8}.json
#   mixed-MODE    mixed prefill+decode steps (the default) against steps taking turns
#                 (--disable-mixed-chunk) in MODE: V2-Lite shape, dummy weights, 1024-in /
#                 256-out at concurrency 256 per GPU (2x that many prompts); under dpa also with
#                 MLA_DPA_PACKED_REDUCE=f32 and with a 2048-token budget per rank
#                                                                 mixed-MODE-CASE.json
#   correctness   group-tests hf-tp hf-dpa chat-replicas chat-tp chat-dpa kill-rank
#   bench         engine-single engine-replicas engine-dpa engine-tp serve-replicas serve-dpa
# NCCL_NVLS_ENABLE=0 is set unless given (NVLink multicast can take a shared host's GPUs down).
# A stage that fails or runs past its limit (MLA_RUN_TIMEOUT_<STAGE>, default 300 s; 600 for
# group-tests) is reported and the next one runs; the exit status is 1 if any failed.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
given=("$@")

usage() {
  if [[ "${1:-2}" == 0 ]]; then
    sed -n '2,/^set -uo/p' "$repo/scripts/gpu_multi_run.sh" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
  fi
  echo "usage: scripts/gpu_multi_run.sh --gpus N --bins DIR --out DIR [--commit SHA] [--dry-run] STAGE... (--help)" >&2
  exit 2
}

gpus= bins= out= commit= dry=0 stages=()
while (($#)); do
  case "$1" in
    --gpus) gpus="${2:?--gpus needs a number}"; shift 2 ;;
    --bins) bins="${2:?--bins needs a directory}"; shift 2 ;;
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    --commit) commit="${2:?--commit needs a commit}"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h | --help) usage 0 ;;
    -*) echo "unknown option $1" >&2; usage ;;
    *) stages+=("$1"); shift ;;
  esac
done
[[ -n "$gpus" && -n "$bins" && -n "$out" && ${#stages[@]} -gt 0 ]] || { echo "--gpus, --bins, --out and a stage are required" >&2; usage; }
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || { echo "--gpus $gpus: expected a positive number" >&2; exit 2; }

modes="single replicas tp dpa"
expanded=()
for s in "${stages[@]}"; do
  case "$s" in
    correctness) expanded+=(group-tests hf-tp hf-dpa nodes-tp nodes-dpa chat-replicas chat-tp chat-dpa kill-rank) ;;
    bench) expanded+=(engine-single engine-replicas engine-dpa engine-tp serve-replicas serve-dpa) ;;
    group-tests | kill-rank | collectives | idle-ranks | soak | matrix | big-v2 | big-v3 | router) expanded+=("$s") ;;
    nodes-tp | nodes-dpa) expanded+=("$s") ;;
    hf-* | chat-* | engine-* | serve-* | kvfp8-* | mixed-*)
      [[ " $modes " == *" ${s#*-} "* ]] || { echo "unknown mode in $s (modes: $modes)" >&2; usage; }
      expanded+=("$s") ;;
    *) echo "unknown stage $s" >&2; usage ;;
  esac
done
stages=()
for s in "${expanded[@]}"; do [[ " ${stages[*]} " == *" $s "* ]] || stages+=("$s"); done
[[ "$bins" == /* ]] || bins="$PWD/$bins"
[[ "$out" == /* ]] || out="$PWD/$out"
cd "$repo"

head_commit="$(git rev-parse --short HEAD 2> /dev/null || echo unknown)"
commit="${commit:-$head_commit}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD" MLA_GIT_COMMIT="$commit"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
port="${MLA_RUN_PORT:-8031}"

if ((dry)); then
  echo "dry run: printing the commands, running none"
else
  mkdir -p "$out"
  exec > >(tee -a "$out/run.log") 2>&1
  echo "scripts/gpu_multi_run.sh ${given[*]}  # $(date -u +%FT%TZ), commit $commit, NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" >> "$out/run.txt"
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  nvidia-smi topo -m 2> /dev/null | head -n $((gpus + 1))
fi
gpu_name="$( ((dry)) && echo "DRY RUN" || nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
echo "commit $commit, $gpus GPU(s), binaries $bins, results $out, stages: ${stages[*]}"
t_start=$(date +%s)
stamp() { echo "== $1 (t+$(($(date +%s) - t_start))s, $(date -u +%FT%TZ))"; }

# The flags of a mode on N GPUs.
flags_of() {
  case "$1" in
    single) echo "" ;;
    replicas) echo "--dp $gpus" ;;
    tp) echo "--tp $gpus" ;;
    dpa) echo "--tp $gpus --enable-dp-attention" ;;
  esac
}

idle_seconds="${MLA_IDLE_SECONDS:-600}"
router_shared="${MLA_ROUTER_SHARED_PROMPTS:-1000}"
router_random="${MLA_ROUTER_RANDOM_PROMPTS:-1024}"
router_turn_delay="${MLA_ROUTER_TURN_DELAY:-2}"
# A sweep of the prefix policy: extra server flags (e.g. the balance thresholds), and which
# modes, policies and workloads run (one GPU's baseline unless MLA_ROUTER_SINGLE=0).
router_flags="${MLA_ROUTER_FLAGS:-}"
router_modes="${MLA_ROUTER_MODES:-replicas dpa}"
router_policies="${MLA_ROUTER_POLICIES:-prefix least-loaded}"
router_benches="${MLA_ROUTER_BENCHES:-multiturn shared random}"
router_single="${MLA_ROUTER_SINGLE:-1}"
soak_seconds="${MLA_SOAK_SECONDS:-1800}"
limit_of() {
  local var="MLA_RUN_TIMEOUT_$(echo "$1" | tr 'a-z-' 'A-Z_')" default=300
  [[ "$1" == group-tests ]] && default=600
  [[ "$1" == idle-ranks ]] && default=$((idle_seconds + 180))
  [[ "$1" == soak ]] && default=$((soak_seconds + 180))
  echo "${!var:-$default}"
}

# run_logged NAME CMD...: CMD under NAME's time limit, output in NAME.log, shown filtered.
run_logged() {
  local name=$1
  shift
  if ((dry)); then echo "  + timeout $(limit_of "$name") $* > $out/$name.log 2>&1"; return 0; fi
  timeout -k 10 "$(limit_of "$name")" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -E '^(test |test result|one rank|TP |DP attention|prefill|decode|ok|FAIL|error|summary|op  |AllReduce|AllGather|ReduceScatter|  )' "$out/$name.log" | head -40
  ((rc == 0)) || { echo "  exit status $rc; last lines:"; tail -n 8 "$out/$name.log" | sed 's/^/    /'; }
  return $rc
}

server_pid=
# server_start LOG ARGS...: mla-serve on $port, waits for /health (180 s).
server_start() {
  local log=$1
  shift
  local cmd=("$bins/mla-serve" --port "$port" "$@")
  if ((dry)); then echo "  + ${cmd[*]} > $log 2>&1 &"; return 0; fi
  echo "== ${cmd[*]}" > "$log"
  "${cmd[@]}" >> "$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && return 0
    kill -0 "$server_pid" 2> /dev/null || break
    sleep 1
  done
  echo "  the server did not become healthy:"
  tail -n 8 "$log" | sed 's/^/    /'
  server_stop
  return 1
}

server_stop() {
  [[ -n "$server_pid" ]] || return 0
  kill -INT "$server_pid" 2> /dev/null
  wait "$server_pid"
  local rc=$?
  server_pid=
  return $rc
}

v2lite_server() {
  local log=$1
  shift
  python3 scripts/wide_tokenizer.py assets/demo "$work/wide" 102400 > /dev/null 2>&1 || true
  # MLA_V2LITE_UTIL and MLA_V2LITE_FLAGS (e.g. --kv-cache-dtype fp8) apply to every V2-Lite server.
  # shellcheck disable=SC2086 # flags are words
  server_start "$log" --model deepseek-v2-lite --load-format dummy --device cuda --tokenizer "$work/wide" \
    --max-num-seqs 256 --max-num-batched-tokens "${MLA_V2LITE_BUDGET:-8192}" \
    --gpu-memory-utilization "${MLA_V2LITE_UTIL:-0.85}" \
    ${MLA_V2LITE_FLAGS:-} "$@"
}

stage_group_tests() { run_logged group-tests "$bins/gpu_group" --ignored --test-threads 1 --nocapture; }

stage_hf() {
  local mode=$1 nodes=${2:-1} name=hf-$1
  ((nodes > 1)) && name=nodes-$1
  ((dry)) || [[ -x "$bins/mla-serve" ]] || { echo "  $bins/mla-serve missing"; return 1; }
  # The e2e test needs the openai package; wheels in .whl/ serve a machine without an index.
  if ((!dry)) && compgen -G ".whl/*.whl" > /dev/null && [[ ! -d "$work/site" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$work/site" .whl/*.whl > /dev/null
  fi
  [[ -d "$work/site" ]] && export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
  # MLA_HF_FLAGS adds server flags (e.g. --disable-mixed-chunk).
  MLA_E2E_DEVICE=cuda MLA_E2E_FLAGS="$(flags_of "$mode") ${MLA_HF_FLAGS:-}" MLA_E2E_NODES=$nodes MLA_SERVE_BIN="$bins/mla-serve" \
    run_logged "$name" python3 -m pytest -q tests/e2e/test_hf_fixtures.py
}

stage_chat() {
  local mode=$1
  # shellcheck disable=SC2046 # flags are words
  v2lite_server "$out/chat-$mode.server.log" $(flags_of "$mode") || return 1
  run_logged "chat-$mode" python3 scripts/gpu_http_check.py "http://127.0.0.1:$port" 48
  local rc=$?
  ((dry)) || curl -s "http://127.0.0.1:$port/metrics" | grep -E '^mla:(num_attention_ranks|rank_)' >> "$out/chat-$mode.log"
  ((dry)) || grep -E 'num_attention_ranks|rank_num_requests_running' "$out/chat-$mode.log" | head -4
  server_stop || rc=1
  return $rc
}

stage_kill_rank() {
  ((gpus >= 2)) || { echo "  needs 2 or more GPUs"; return 0; }
  MLA_TEST_KILL_RANK=1:40 v2lite_server "$out/kill-rank.server.log" --tp "$gpus" --enable-dp-attention \
    --shutdown-timeout 5 || return 1
  ((dry)) && { echo "  + 16 concurrent requests; expect every one answered and a non-zero exit within 60 s"; return 0; }
  local t0 rc
  t0=$(date +%s)
  python3 - "$port" > "$out/kill-rank.log" 2>&1 << 'EOF'
import json, sys, urllib.request, concurrent.futures
port = sys.argv[1]
def one(i):
    body = json.dumps({"model": "deepseek-v2-lite", "prompt": f"request {i}", "max_tokens": 200, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return f"{r.status} completed"
    except urllib.error.HTTPError as e:
        return f"{e.code} {json.loads(e.read())['error']['message'][:120]}"
    except Exception as e:
        return f"no answer: {e}"
with concurrent.futures.ThreadPoolExecutor(16) as p:
    for r in p.map(one, range(16)):
        print(r)
EOF
  for _ in $(seq 60); do kill -0 "$server_pid" 2> /dev/null || break; sleep 1; done
  if kill -0 "$server_pid" 2> /dev/null; then
    echo "  the server is still running 60 s after the rank died"
    kill -9 "$server_pid"
    server_pid=
    return 1
  fi
  wait "$server_pid"
  rc=$?
  server_pid=
  echo "  server exit status $rc after $(($(date +%s) - t0)) s; answers:"
  sort "$out/kill-rank.log" | uniq -c | sed 's/^/    /'
  grep -E 'engine stopped|killed at step' "$out/kill-rank.server.log" | head -3 | cut -c1-240 | sed 's/^/    /'
  ! grep -q 'no answer' "$out/kill-rank.log" && ((rc != 0))
}

stage_engine() {
  local mode=$1 per=1
  case "$mode" in replicas | dpa) per=$gpus ;; esac
  # Decode batches are totals over the layout: 256 sequences per GPU where each GPU has its own.
  # shellcheck disable=SC2046
  run_logged "engine-$mode" "$bins/mla-bench" engine --config configs/deepseek-v2-lite.json $(flags_of "$mode") \
    --gpu-memory-utilization 0.85 --prefill-reps 3 --decode "$per"x1024x128,$((256 * per))x4096x64 \
    --max-num-seqs 256 --out "$out/engine-$mode.json"
}

stage_serve() {
  local mode=$1 per=1 c
  case "$mode" in replicas | dpa) per=$gpus ;; esac
  c=$((256 * per))
  # shellcheck disable=SC2046
  v2lite_server "$out/serve-$mode.server.log" $(flags_of "$mode") || return 1
  run_logged "serve-$mode" "$bins/mla-bench" serve --base-url "http://127.0.0.1:$port" --input-len 1024 \
    --output-len 256 --num-prompts $((4 * c)) --max-concurrency "$c" --ignore-eos --temperature 0 \
    --gpu "$gpu_name x$gpus $mode" --out "$out/serve-$mode.json"
  local rc=$?
  server_stop || rc=1
  return $rc
}

stage_kvfp8() {
  local mode=$1 per=1 c dt rc=0
  case "$mode" in replicas | dpa) per=$gpus ;; esac
  c=$((256 * per))
  for dt in auto fp8; do
    # shellcheck disable=SC2046
    MLA_V2LITE_UTIL="${MLA_KVFP8_UTIL:-0.5}" v2lite_server "$out/kvfp8-$mode-$dt.server.log" $(flags_of "$mode") \
      --kv-cache-dtype "$dt" || return 1
    ((dry)) || grep -h "KV cache" "$out/kvfp8-$mode-$dt.server.log" | sed "s/^/$dt: /" >> "$out/kvfp8-$mode.log"
    serve_case "kvfp8-$mode-$dt" "$c" $((2 * c)) 256 || rc=1
    server_stop || rc=1
  done
  return $rc
}

stage_mixed() {
  local mode=$1 per=1 c rc=0 case
  case "$mode" in replicas | dpa) per=$gpus ;; esac
  c=$((256 * per))
  # name|settings and flags: prefill and decode taking turns, then mixed steps (the default);
  # under DP attention also with the eager steps' FFN outputs reduced in f32 instead of bf16,
  # and with a quarter of the token budget per rank (SGLang divides its chunk by the DP size).
  local cases=("turns|--disable-mixed-chunk" "mixed|")
  [[ "$mode" == dpa ]] && cases+=("mixed-f32|MLA_DPA_PACKED_REDUCE=f32"
    "mixed-2k|MLA_V2LITE_BUDGET=2048")
  for case in "${cases[@]}"; do
    local name=${case%%|*} words
    read -r -a words <<< "${case#*|}"
    local envs=() flags=()
    for a in "${words[@]}"; do [[ "$a" == MLA_*=* ]] && envs+=("$a") || flags+=("$a"); done
    # shellcheck disable=SC2046
    (((${#envs[@]})) && export "${envs[@]}"; v2lite_server "$out/mixed-$mode-$name.server.log" $(flags_of "$mode") \
      "${flags[@]}" && serve_case "mixed-$mode-$name" "$c" $((2 * c)) 256; r=$?; server_stop || r=1; exit $r) \
      || rc=1
  done
  return $rc
}

stage_collectives() {
  run_logged collectives "$bins/mla-bench" collectives --gpus "$gpus" --out "$out/collectives.json"
}

stage_idle_ranks() {
  v2lite_server "$out/idle-ranks.server.log" --tp "$gpus" --enable-dp-attention || return 1
  run_logged idle-ranks python3 scripts/idle_ranks.py "http://127.0.0.1:$port" "$idle_seconds" "$out/idle-ranks.json"
  local rc=$?
  server_stop || rc=1
  return $rc
}

stage_soak() {
  v2lite_server "$out/soak.server.log" --tp "$gpus" --enable-dp-attention || return 1
  run_logged soak python3 scripts/soak.py "http://127.0.0.1:$port" "$soak_seconds" $((256 * gpus)) "$out/soak.json" \
    "${server_pid:--}"
  local rc=$?
  server_stop || rc=1
  return $rc
}

# serve_case NAME CONCURRENCY PROMPTS OUTPUT_LEN: mla-bench serve against the running server,
# 1024-token prompts; fails when any request failed.
serve_case() {
  local name=$1 c=$2 n=$3 olen=$4
  run_logged "$name" "$bins/mla-bench" serve --base-url "http://127.0.0.1:$port" --input-len 1024 \
    --output-len "$olen" --num-prompts "$n" --max-concurrency "$c" --ignore-eos --temperature 0 \
    --gpu "$gpu_name x$gpus" --out "$out/$name.json" || return 1
  ((dry)) && return 0
  python3 - "$out/$name.json" << 'EOF'
import json, sys
m = json.load(open(sys.argv[1]))["results"]["metrics"]
print(f"  {m['completed']} completed, {m['failed']} failed, {m['output_throughput']:.0f} output tok/s, "
      f"median TTFT {m['ttft']['median_ms']:.0f} ms, P99 ITL {m['itl']['p99_ms']:.1f} ms")
sys.exit(m["failed"] > 0)
EOF
}

stage_matrix() {
  local w mode rc=0 c128 c512
  IFS=, read -r c128 c512 <<< "${MLA_MATRIX_PROMPTS:-256,512}"
  python3 scripts/wide_tokenizer.py assets/demo "$work/wide" 102400 > /dev/null 2>&1 || true
  for w in bf16 fp8; do
    for mode in replicas tp dpa; do
      local quant=() tag="$w-$mode"
      [[ "$w" == fp8 ]] && quant=(--quantization fp8)
      # Default flags, as a user starts it: the step budget, batch and memory are the server's.
      # shellcheck disable=SC2046
      server_start "$out/matrix-$tag.server.log" --model deepseek-v2-lite --load-format dummy --device cuda \
        --tokenizer "$work/wide" $(flags_of "$mode") "${quant[@]}" || { rc=1; continue; }
      ((dry)) || grep -E 'steps:|KV cache:|cut to' "$out/matrix-$tag.server.log" | cut -c1-200 | sed 's/^/  /'
      serve_case "matrix-$tag-c128" 128 "$c128" 128 || rc=1
      serve_case "matrix-$tag-c512" 512 "$c512" 128 || rc=1
      if ((dry)); then echo "  + teacher_forced.py dump"; else
        python3 scripts/teacher_forced.py dump "http://127.0.0.1:$port" "$out/tf-$tag.json" 16 256 100000 || rc=1
      fi
      server_stop || { echo "  the $tag server did not exit cleanly"; rc=1; }
    done
  done
  ((dry)) && return $rc
  # FP8 against bf16 in each mode: the quantization noise, which must not depend on the layout.
  # (Layouts are not compared with each other here: dummy weights are drawn per rank's shard, so
  # each layout has other weights; the hf-MODE stages and the CPU matrix compare layouts.)
  local pairs=()
  for mode in replicas tp dpa; do pairs+=("$out/tf-bf16-$mode.json" "$out/tf-fp8-$mode.json"); done
  python3 scripts/teacher_forced.py noise "${pairs[@]}" | tee "$out/matrix-tf.log" || rc=1
  return $rc
}

# stage_big v2|v3: a large FP8 model at default flags under tp and dpa.
stage_big() {
  local model=$1 mode rc=0 olen="${MLA_BIG_OUTPUT:-1024}" extra=() vocab=102400
  if [[ "$model" == v3 ]]; then
    vocab=129280
    extra=(--hf-overrides "{\"num_hidden_layers\": ${MLA_V3_LAYERS:-16}}")
  fi
  python3 scripts/wide_tokenizer.py assets/demo "$work/wide-$model" "$vocab" > /dev/null 2>&1 || true
  for mode in ${MLA_BIG_MODES:-tp dpa}; do
    local tag="big-$model-$mode"
    # shellcheck disable=SC2046,SC2086 # flags are words
    server_start "$out/$tag.server.log" --model "deepseek-$model" --load-format dummy --device cuda \
      --tokenizer "$work/wide-$model" --quantization fp8 $(flags_of "$mode") "${extra[@]}" ${MLA_BIG_FLAGS:-} ||
      { rc=1; continue; }
    ((dry)) || grep -E 'weights|steps:|KV cache|cut to|trying' "$out/$tag.server.log" | cut -c1-220 | sed 's/^/  /'
    local c
    for c in ${MLA_BIG_CONCURRENCY:-1 64 256}; do
      serve_case "$tag-c$c" "$c" $((c > 1 ? c : 2)) "$olen" || rc=1
    done
    server_stop || { echo "  the $tag server did not exit cleanly"; rc=1; }
  done
  return $rc
}

# router_bench NAME ARGS...: mla-bench serve against the running server (greedy, ignore_eos),
# results in NAME.json; the router's decisions after it are appended to NAME.log.
router_bench() {
  local name=$1 n=$gpus
  shift
  [[ "$name" == router-single-* ]] && n=1
  run_logged "$name" "$bins/mla-bench" serve --base-url "http://127.0.0.1:$port" --ignore-eos --temperature 0 \
    --gpu "$gpu_name x$n" --out "$out/$name.json" "$@" || return 1
  ((dry)) && return 0
  grep -E 'throughput|Median TTFT|hit rate|Failed' "$out/$name.log" | head -6 | sed 's/^/  /'
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^mla:(router_decisions_total|rank_prefix_cache)' >> "$out/$name.log"
}

# The three workloads of the router stage, against the server of one mode and policy.
router_workloads() {
  local tag=$1 rc=0
  wants() { [[ " $router_benches " == *" $1 "* ]]; }
  if wants multiturn; then
    router_bench "$tag-multiturn" --dataset multi-turn --num-prompts 64 --num-turns 8 --input-len 512 \
      --output-len 128 --max-concurrency 64 --turn-delay "$router_turn_delay" || rc=1
  fi
  [[ "$tag" == *single* ]] && return $rc
  if wants shared; then
    router_bench "$tag-shared" --dataset-name prefix_repetition --num-prompts "$router_shared" \
      --prefix-repetition-prefix-len 2000 --prefix-repetition-suffix-len 200 --prefix-repetition-num-prefixes 1 \
      --output-len 128 --max-concurrency 64 || rc=1
  fi
  if wants random; then
    router_bench "$tag-random" --input-len 1024 --output-len 256 --num-prompts "$router_random" \
      --max-concurrency 256 || rc=1
  fi
  return $rc
}

stage_router() {
  ((gpus >= 2)) || { echo "  needs 2 or more GPUs"; return 0; }
  local mode policy rc=0
  # One GPU of this machine: the hit rate the layouts are held to.
  if ((router_single)); then
    CUDA_VISIBLE_DEVICES=0 v2lite_server "$out/router-single.server.log" || return 1
    router_workloads router-single || rc=1
    server_stop || rc=1
  fi
  for mode in $router_modes; do
    for policy in $router_policies; do
      local extra=""
      [[ "$policy" == prefix ]] && extra="$router_flags"
      # shellcheck disable=SC2046,SC2086
      v2lite_server "$out/router-$mode-$policy.server.log" $(flags_of "$mode") --router-policy "$policy" $extra ||
        { rc=1; continue; }
      ((dry)) || grep -E 'routing over' "$out/router-$mode-$policy.server.log" | cut -c1-220 | sed 's/^/  /'
      router_workloads "router-$mode-$policy" || rc=1
      server_stop || rc=1
    done
  done
  ((dry)) && { echo "  + scripts/router_compare.py $out"; return $rc; }
  # A partial sweep has nothing to compare against; its JSON files are the result.
  [[ "$router_modes $router_policies $router_benches $router_single" == "replicas dpa prefix least-loaded multiturn shared random 1" ]] ||
    return $rc
  python3 scripts/router_compare.py "$out" | tee "$out/router-summary.log" || rc=1
  return $rc
}

status=0
for s in "${stages[@]}"; do
  stamp "$s"
  case "$s" in
    group-tests) stage_group_tests ;;
    kill-rank) stage_kill_rank ;;
    collectives) stage_collectives ;;
    idle-ranks) stage_idle_ranks ;;
    soak) stage_soak ;;
    matrix) stage_matrix ;;
    big-*) stage_big "${s#big-}" ;;
    router) stage_router ;;
    hf-*) stage_hf "${s#hf-}" ;;
    nodes-*) stage_hf "${s#nodes-}" "$gpus" ;;
    chat-*) stage_chat "${s#chat-}" ;;
    engine-*) stage_engine "${s#engine-}" ;;
    serve-*) stage_serve "${s#serve-}" ;;
    kvfp8-*) stage_kvfp8 "${s#kvfp8-}" ;;
    mixed-*) stage_mixed "${s#mixed-}" ;;
  esac || { status=1; echo "  stage $s FAILED"; }
done
stamp done
exit $status
