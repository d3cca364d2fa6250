#!/usr/bin/env bash
# One benchmark-and-test run on a GPU machine, in named stages, from binaries built elsewhere
# (`scripts/gpu_tests.sh --build DIR` puts mla-serve, mla-bench and the gpu_* test binaries in DIR).
# The GPU machine needs only bash, python3, curl, timeout and nvidia-smi, and a checkout of the
# commit the binaries were built from (for configs/, assets/demo, scripts/ and tests/e2e).
#
#   scripts/gpu_run.sh --bins DIR --out DIR [--commit SHA] [--dry-run] STAGE...
#
# Stages, run in the order given; each writes fixed file names under --out:
#   kernels        mla-bench kernels                          kernels.json
#   engine         mla-bench engine                           engine.json
#   engine-nopdl   the same with MLA_DISABLE_PDL=1            engine-nopdl.json
#   serve-cN       mla-bench serve at concurrency N against   serve-cN.json, server.log,
#                  mla-serve (V2-Lite shape, dummy weights,   server-steps.log
#                  a tokenizer covering its whole vocabulary)
#   tests          scripts/gpu_tests.sh DIR                   gpu-tests.log
#   prefix-cache   the prefix-cache e2e test on cuda, then     prefix-{multiturn,multiturn-c8,multiturn-c1,shared,random}-
#                  with caching on and off: 64 conversations   {on,off}.json, prefix-e2e.log
#                  of 8 turns of 512 tokens (128 out) at c=64
#                  and 8 of them at c=8 and at c=1,
#                  1000 prompts of a shared 2000-token prefix
#                  + 200 own tokens (128 out) at c=64, and
#                  1024 random 1024/256 prompts at c=256
#   structured     structured output on the GPU server:        structured-check.log,
#                  scripts/gpu_structured_check.py, then      structured-c{1,64}-{plain,regex}.json,
#                  mla-bench serve at c=1 and c=64, plain      structured-masks.log
#                  and every token under a grammar (a regex
#                  that cannot end within 256 tokens)
#   ncu            ncu per-kernel times of eager steps        ncu.csv, ncu-breakdown.md
#   all            kernels engine engine-nopdl serve-c1 serve-c256 tests (not ncu)
# Every stage also leaves its whole output in STAGE.log (the tests stage: gpu-tests.log); the
# console shows the lines that matter, and all of it goes to run.log. run.txt gets the invocation.
#
# A stage that fails or runs past its time limit is reported and the next stages still run; the
# exit status is 1 if any stage failed. The serving stages share one server, started by the first
# and stopped before any other stage (the tests start their own).
#
# Environment overrides (defaults in brackets):
#   MLA_RUN_KERNELS        benchmarks of the kernels stage [decode_attention,prefill_attention,moe_experts]
#   MLA_RUN_ENGINE_DECODE  decode cases of engine [1x1024x256,16x4096x64,64x4096x64,128x4096x64,256x4096x64]
#   MLA_RUN_NOPDL_DECODE   decode cases of engine-nopdl [1x1024x256,256x4096x64]
#   MLA_RUN_ENGINE_ARGS    more arguments for both engine stages, e.g. "--no-gemv" []
#   MLA_RUN_NCU_BATCH      decode batch sizes of the ncu stage, comma separated [256]
#   MLA_RUN_NCU_PREFILL    prompt length of its prefill step, 0 for none [4096]
#   MLA_RUN_PORT           port of the benchmark server [8011]
#   MLA_RUN_TIMEOUT_<STAGE> time limit in seconds, e.g. MLA_RUN_TIMEOUT_SERVE_C256=600
#                          [kernels 180, engine 300, engine-nopdl 180, serve-c1 120,
#                           serve-c256 300, other serve-cN 240, tests 600, structured 420,
#                           ncu 300]
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
given=("$@")

# usage 0: the help above; usage: a one-line reminder after a wrong invocation (status 2).
usage() {
  if [[ "${1:-2}" == 0 ]]; then
    sed -n '2,/^set -uo/p' "$repo/scripts/gpu_run.sh" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
  fi
  echo "usage: scripts/gpu_run.sh --bins DIR --out DIR [--commit SHA] [--dry-run] STAGE... (--help for more)" >&2
  exit 2
}

bins= out= commit= dry=0 stages=()
while (($#)); do
  case "$1" in
    --bins) bins="${2:?--bins needs a directory}"; shift 2 ;;
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    --commit) commit="${2:?--commit needs a commit}"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h | --help) usage 0 ;;
    -*) echo "unknown option $1" >&2; usage ;;
    *) stages+=("$1"); shift ;;
  esac
done
[[ -n "$bins" && -n "$out" && ${#stages[@]} -gt 0 ]] || { echo "--bins, --out and a stage are required" >&2; usage; }

# `all`, expanded; unknown names are refused before anything runs; a stage named twice runs once.
expanded=()
for s in "${stages[@]}"; do
  case "$s" in
    all) expanded+=(kernels engine engine-nopdl serve-c1 serve-c256 tests) ;;
    kernels | engine | engine-nopdl | tests | ncu | prefix-cache | structured) expanded+=("$s") ;;
    serve-c[1-9]*) [[ "$s" =~ ^serve-c[0-9]+$ ]] || { echo "unknown stage $s" >&2; usage; }; expanded+=("$s") ;;
    *) echo "unknown stage $s" >&2; usage ;;
  esac
done
stages=()
for s in "${expanded[@]}"; do
  [[ " ${stages[*]} " == *" $s "* ]] || stages+=("$s")
done
((dry)) || [[ -d "$bins" ]] || { echo "--bins $bins: no such directory" >&2; exit 2; }
# Paths as given are relative to the caller; every command below runs in the repository root.
[[ "$bins" == /* ]] || bins="$PWD/$bins"
[[ "$out" == /* ]] || out="$PWD/$out"
cd "$repo"

head_commit="$(git rev-parse --short HEAD 2> /dev/null || echo unknown)"
commit="${commit:-$head_commit}"
work="$(mktemp -d)"
port="${MLA_RUN_PORT:-8011}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" MLA_REPO_ROOT="$PWD" MLA_GIT_COMMIT="$commit"

# The invocation as typed, with the overrides that shaped it, for run.txt.
invocation="$(env | grep -E '^(MLA_RUN_[A-Z0-9_]+|MLA_DISABLE_PDL)=' | sort | tr '\n' ' ')"
invocation+="scripts/gpu_run.sh ${given[*]}  # $(date -u +%FT%TZ), commit $commit"
if ((dry)); then
  echo "dry run: printing the commands, running none; run.txt would get:"
  echo "  $invocation"
else
  mkdir -p "$out"
  # Everything below also goes to run.log.
  exec > >(tee -a "$out/run.log") 2>&1
  echo "$invocation" >> "$out/run.txt"
fi
echo "commit $commit (checkout $head_commit), binaries $bins, results $out, stages: ${stages[*]}"
[[ "$commit" == "$head_commit" ]] || echo "warning: the checkout is at $head_commit, not $commit; configs and scripts come from the checkout"
if ((!dry)); then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
fi
gpu_name="$( ((dry)) && echo "DRY RUN" || nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
gpu_name="${gpu_name:-unknown}"

t_start=$(date +%s)
stamp() { echo "== $1 (t+$(($(date +%s) - t_start))s, $(date -u +%FT%TZ))"; }

limit_of() {
  local var="MLA_RUN_TIMEOUT_$(echo "$1" | tr 'a-z-' 'A-Z_')" default
  case "$1" in
    kernels | engine-nopdl) default=180 ;;
    engine | serve-c256 | ncu) default=300 ;;
    serve-c1) default=120 ;;
    serve-c*) default=240 ;;
    tests | prefix-cache) default=600 ;;
    structured) default=420 ;;
  esac
  echo "${!var:-$default}"
}

need_bin() {
  [[ -x "$bins/$1" ]] && return 0
  echo "  $bins/$1 is missing (scripts/gpu_tests.sh --build DIR builds it)"
  ((dry))
}

# show CMD...: prints a command as it would be typed (quoting only the words that need it).
show() {
  local w plain='^[][A-Za-z0-9_./,:=@+%-]+$' quote="'\\''"
  printf '  +'
  for w in "$@"; do
    if [[ "$w" =~ $plain ]]; then printf ' %s' "$w"; else printf " '%s'" "${w//\'/$quote}"; fi
  done
}

# bounded LIMIT LOG FILTER [--stdout FILE] CMD...: runs CMD under the time limit with its output
# in LOG (its stdout in FILE if given) and shows the lines of LOG that match FILTER; on failure
# also the last lines, so that the console says why.
bounded() {
  local limit=$1 log=$2 filter=$3 stdout=
  shift 3
  if [[ "$1" == --stdout ]]; then stdout=$2; shift 2; fi
  if ((dry)); then
    show timeout "$limit" "$@"
    [[ -n "$stdout" ]] && echo " > $stdout 2> $log" || echo " > $log 2>&1"
    return 0
  fi
  local rc
  if [[ -n "$stdout" ]]; then
    timeout -k 10 "$limit" "$@" > "$stdout" 2> "$log"
  else
    timeout -k 10 "$limit" "$@" > "$log" 2>&1
  fi
  rc=$?
  grep -E "$filter" "$log"
  if ((rc == 124 || rc == 137)); then
    echo "  timed out after ${limit}s"
  elif ((rc != 0)); then
    echo "  exit status $rc; the last lines of $log:"
    tail -n 5 "$log" | sed 's/^/    /'
  fi
  return $rc
}

# quiet CMD...: a set-up command whose output matters only if it fails.
quiet() {
  if ((dry)); then show "$@"; echo; return 0; fi
  local o
  o="$("$@" 2>&1)" || { echo "  failed: $*"; echo "$o" | tail -n 5 | sed 's/^/    /'; return 1; }
}

stage_kernels() {
  need_bin mla-bench || return 1
  bounded "$(limit_of kernels)" "$out/kernels.log" '.' \
    "$bins/mla-bench" kernels --only "${MLA_RUN_KERNELS:-decode_attention,prefill_attention,moe_experts}" \
    --out "$out/kernels.json"
}

# engine_stage NAME DECODE [ENV=VALUE...]
engine_stage() {
  local name=$1 decode=$2
  shift 2
  need_bin mla-bench || return 1
  # MLA_RUN_ENGINE_ARGS unquoted on purpose: it is a list of words.
  bounded "$(limit_of "$name")" "$out/$name.log" '^(prefill|decode)' \
    env "$@" "$bins/mla-bench" engine --decode "$decode" ${MLA_RUN_ENGINE_ARGS:-} --out "$out/$name.json"
}

server_pid= server_state=down
server_up() {
  case $server_state in
    up) return 0 ;;
    failed) echo "  the server did not start (see server.log)"; return 1 ;;
  esac
  server_state=failed
  need_bin mla-serve || return 1
  stamp server-start
  # The demo tokenizer has 512 ids and the dummy model samples from the whole vocabulary; ids
  # without text send no stream chunk, which would hide tokens from the inter-token latency.
  local vocab tok="$work/wide-tokenizer"
  vocab="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' configs/deepseek-v2-lite.json)" || return 1
  quiet python3 scripts/wide_tokenizer.py assets/demo "$tok" "$vocab" || return 1
  local cmd=("$bins/mla-serve" --model deepseek-v2-lite --load-format dummy --device cuda --tokenizer "$tok"
    --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --port "$port")
  # shellcheck disable=SC2206 # extra flags are words
  cmd+=(${MLA_RUN_SERVER_ARGS:-})
  if ((dry)); then
    show "${cmd[@]}"; echo " >> $out/server.log 2>&1 &"
    server_state=up
    return 0
  fi
  # Appended to: a second serving block in one run must not erase the first one's log.
  echo "== $(date -u +%FT%TZ) ${cmd[*]}" >> "$out/server.log"
  "${cmd[@]}" >> "$out/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 180); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then
      server_state=up
      return 0
    fi
    kill -0 "$server_pid" 2> /dev/null || break
    sleep 1
  done
  echo "  the server did not become healthy; the last lines of server.log:"
  tail -n 5 "$out/server.log" | sed 's/^/    /'
  kill -INT "$server_pid" 2> /dev/null
  wait "$server_pid" 2> /dev/null
  server_pid=
  return 1
}

# Stops the server (SIGINT: a graceful shutdown) and keeps its per-step summaries.
server_down() {
  [[ $server_state == up ]] || return 0
  server_state=down
  stamp server-stop
  ((dry)) && { echo "  + kill -INT <server>; grep -E 'last [0-9]+ steps' server.log > server-steps.log"; return 0; }
  kill -INT "$server_pid" 2> /dev/null
  wait "$server_pid"
  echo "  server exit status $?"
  server_pid=
  grep -E "last [0-9]+ steps" "$out/server.log" > "$out/server-steps.log"
  tail -n 4 "$out/server-steps.log"
}
trap 'server_down; rm -rf "$work"' EXIT

stage_serve() {
  local name=$1 c=${1#serve-c} prompts
  # Concurrency 1 measures inter-token latency (a dozen requests suffice); the 1000 at 256 are
  # what the earlier runs used; otherwise four waves.
  case $c in
    1) prompts=12 ;;
    256) prompts=1000 ;;
    *) prompts=$((4 * c)) ;;
  esac
  need_bin mla-bench || return 1
  server_up || return 1
  # --temperature 0: greedy, as every recorded run sampled (mla-bench sends no temperature
  # unless asked, as vllm bench serve does).
  bounded "$(limit_of "$name")" "$out/$name.log" 'throughput|TTFT|TPOT|ITL|Failed|^Error|duration' \
    "$bins/mla-bench" serve --base-url "http://127.0.0.1:$port" --input-len 1024 --output-len 256 \
    --num-prompts "$prompts" --max-concurrency "$c" --ignore-eos --temperature 0 --gpu "$gpu_name" \
    --out "$out/$name.json"
}

wheels() {
  # The e2e tests need the openai package; wheels in .whl/ serve a machine without an index.
  if compgen -G ".whl/*.whl" > /dev/null && [[ ! -d "$work/site" ]]; then
    quiet python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$work/site" .whl/*.whl || return 1
  fi
  [[ -d "$work/site" ]] && export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
  return 0
}

stage_prefix_cache() {
  local rc=0 mode
  local bench=("$bins/mla-bench" serve --base-url "http://127.0.0.1:$port" --ignore-eos --temperature 0
    --gpu "$gpu_name")
  wheels || return 1
  MLA_E2E_DEVICE=cuda MLA_SERVE_BIN="$bins/mla-serve" bounded 120 "$out/prefix-e2e.log" 'passed|failed|Error' \
    python3 -m pytest -q tests/e2e/test_prefix_cache.py || rc=1
  for mode in on off; do
    MLA_RUN_SERVER_ARGS="$([[ $mode == off ]] && echo --no-enable-prefix-caching)" server_up || return 1
    bounded 150 "$out/prefix-multiturn-$mode.log" 'throughput|TTFT|hit rate|Failed|^Error' "${bench[@]}" \
      --dataset multi-turn --num-prompts 64 --num-turns 8 --input-len 512 --output-len 128 --max-concurrency 64 \
      --out "$out/prefix-multiturn-$mode.json" || rc=1
    # The same at concurrency 8: time to first token with little queueing in front of it.
    bounded 150 "$out/prefix-multiturn-c8-$mode.log" 'throughput|TTFT|hit rate|Failed|^Error' "${bench[@]}" \
      --dataset multi-turn --num-prompts 8 --num-turns 8 --input-len 512 --output-len 128 --max-concurrency 8 \
      --seed 1 --out "$out/prefix-multiturn-c8-$mode.json" || rc=1
    # One conversation at a time: a later turn's first token waits only for its own prefill.
    bounded 150 "$out/prefix-multiturn-c1-$mode.log" 'throughput|TTFT|hit rate|Failed|^Error' "${bench[@]}" \
      --dataset multi-turn --num-prompts 8 --num-turns 8 --input-len 512 --output-len 128 --max-concurrency 1 \
      --seed 2 --out "$out/prefix-multiturn-c1-$mode.json" || rc=1
    bounded 150 "$out/prefix-shared-$mode.log" 'throughput|TTFT|hit rate|Failed|^Error' "${bench[@]}" \
      --dataset-name prefix_repetition --num-prompts 1000 --prefix-repetition-prefix-len 2000 \
      --prefix-repetition-suffix-len 200 --prefix-repetition-num-prefixes 1 --output-len 128 \
      --max-concurrency 64 --out "$out/prefix-shared-$mode.json" || rc=1
    bounded 150 "$out/prefix-random-$mode.log" 'Output token throughput|Median TTFT|hit rate|Failed|^Error' \
      "${bench[@]}" --input-len 1024 --output-len 256 --num-prompts 1024 --max-concurrency 256 \
      --out "$out/prefix-random-$mode.json" || rc=1
    server_down
  done
  return $rc
}

stage_structured() {
  local rc=0 c mode prompts extra
  # Every token of the constrained runs is under a grammar: a regex that cannot end within the
  # 256 output tokens (the wide tokenizer's ids are words " w<id>").
  local regex='( w[0-9]+){300}'
  wheels || return 1
  need_bin mla-bench || return 1
  # No prefix caching: the constrained runs send the plain runs' prompts again, and cached
  # prefills would flatter them.
  MLA_RUN_SERVER_ARGS="--no-enable-prefix-caching ${MLA_RUN_SERVER_ARGS:-}" server_up || return 1
  bounded 240 "$out/structured-check.log" '^ok|^FAIL|passed|failed|Error' \
    python3 scripts/gpu_structured_check.py "http://127.0.0.1:$port" deepseek-v2-lite 32 || rc=1
  for c in 1 64; do
    prompts=$((c == 1 ? 12 : 4 * c))
    for mode in plain regex; do
      extra=()
      [[ $mode == regex ]] && extra=(--extra-body "{\"guided_regex\": \"$regex\"}")
      bounded 150 "$out/structured-c$c-$mode.log" 'throughput|TPOT|ITL|Failed|^Error' "$bins/mla-bench" serve \
        --base-url "http://127.0.0.1:$port" --input-len 1024 --output-len 256 --num-prompts "$prompts" \
        --max-concurrency "$c" --ignore-eos --temperature 0 --gpu "$gpu_name" "${extra[@]}" \
        --out "$out/structured-c$c-$mode.json" || rc=1
    done
  done
  ((dry)) || grep -E "grammar masks" "$out/server.log" > "$out/structured-masks.log"
  return $rc
}

stage_tests() {
  wheels || return 1
  bounded "$(limit_of tests)" "$out/gpu-tests.log" \
    '^== |test result|panicked|FAILED|passed|failed|KV cache|graphs|requests' scripts/gpu_tests.sh "$bins"
}

stage_ncu() {
  need_bin mla-bench || return 1
  local ncu
  ncu="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2> /dev/null | head -1)"
  ((dry)) && ncu="${ncu:-ncu}"
  [[ -n "$ncu" ]] || { echo "  ncu (Nsight Compute) not found"; return 1; }
  local batches="${MLA_RUN_NCU_BATCH:-256}" prefill="${MLA_RUN_NCU_PREFILL:-4096}" names=() b
  bounded "$(limit_of ncu)" "$out/ncu.log" 'eager' --stdout "$out/ncu.csv" \
    "$ncu" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    "$bins/mla-bench" profile --batch "$batches" --context 4096 --prefill-len "$prefill" || return 1
  # Step names in the order `mla-bench profile` runs them.
  for b in ${batches//,/ }; do names+=("decode B=$b ctx 4096 (eager)"); done
  ((prefill > 0)) && names+=("prefill $prefill tokens (eager)")
  bounded 60 "$out/ncu-breakdown.log" '^##|^\| [a-zA-Z]' --stdout "$out/ncu-breakdown.md" \
    python3 scripts/ncu_breakdown.py "$out/ncu.csv" "${names[@]}" || return 1
  ((dry)) || grep -E '^##|^\| [a-zA-Z]' "$out/ncu-breakdown.md" | head -30
}

failed=() summary=()
for s in "${stages[@]}"; do
  [[ $s == serve-c* ]] || server_down
  stamp "$s"
  t0=$(date +%s)
  case $s in
    kernels) stage_kernels ;;
    engine) engine_stage engine "${MLA_RUN_ENGINE_DECODE:-1x1024x256,16x4096x64,64x4096x64,128x4096x64,256x4096x64}" ;;
    engine-nopdl) engine_stage engine-nopdl "${MLA_RUN_NOPDL_DECODE:-1x1024x256,256x4096x64}" MLA_DISABLE_PDL=1 ;;
    serve-c*) stage_serve "$s" ;;
    tests) stage_tests ;;
    ncu) stage_ncu ;;
    prefix-cache) stage_prefix_cache ;;
    structured) stage_structured ;;
  esac
  rc=$?
  ((rc == 0)) || failed+=("$s")
  summary+=("$(printf '%-14s %-6s %5ss' "$s" "$( ((rc == 0)) && echo ok || echo FAILED)" $(($(date +%s) - t0)))")
done
server_down
stamp done
printf '  %s\n' "${summary[@]}"
if ((${#failed[@]})); then
  echo "failed stages: ${failed[*]}"
  exit 1
fi
