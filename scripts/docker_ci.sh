#!/usr/bin/env bash
# Builds the image from the real Dockerfile and uses it as an operator would: starts a container
# with the bundled demo model on the CPU, checks /health, the image's HEALTHCHECK and chat
# completions over HTTP from the host, then stops it with SIGTERM. .ci/run runs it on every CI
# run; a developer can run it alone (as root where it has to install Docker).
#
#   scripts/docker_ci.sh
#
# Without a running Docker daemon it installs Debian's docker.io (and debootstrap), starts
# dockerd without a bridge or iptables rules (containers use the host's network, so nothing on
# the machine's network changes) and stops it at the end. With no registry in reach, the base
# image is made from Debian's packages (scripts/docker_base.sh); MLA_DOCKER_BASE_IMAGE=IMAGE
# (e.g. debian:bookworm-slim) builds from a registry's image instead.
#
# At the end it removes its container and image, and where it started the daemon itself, every
# image and the build cache too (disk is tight in CI). MLA_DOCKER_KEEP=1 keeps them all, and the
# daemon running, so that a second run shows what the layer cache saves.
set -euo pipefail
cd "$(dirname "$0")/.."

image="${MLA_DOCKER_IMAGE:-mla-serve:ci}"
base="${MLA_DOCKER_BASE_IMAGE:-}"
keep="${MLA_DOCKER_KEEP:-0}"
container="mla-serve-ci-$$"
work="$(mktemp -d)"
t0=$SECONDS
passed=0
phase() { printf '== docker [%4ds] %s\n' $((SECONDS - t0)) "$*"; }
check() {
  passed=$((passed + 1))
  echo "   ok: $*"
}
fail() {
  echo "error: $*" >&2
  exit 1
}

# The docker.io client matches its daemon; some machines put a newer client first in PATH.
docker="${DOCKER:-$(command -v /usr/bin/docker || command -v docker || true)}"
dockerd_pid=
build_s=

cleanup() {
  local status=$?
  set +e
  if [[ -n "$docker" ]] && "$docker" info > /dev/null 2>&1; then
    "$docker" rm -f "$container" "$container-host" > /dev/null 2>&1
    if [[ "$keep" != 1 ]]; then
      "$docker" image rm -f "$image" > /dev/null 2>&1
      if [[ -n "$dockerd_pid" ]]; then
        # Our own daemon: nothing in it is anyone else's.
        "$docker" system prune -af > /dev/null 2>&1
        "$docker" builder prune -af > /dev/null 2>&1
      fi
    fi
  fi
  if [[ -n "$dockerd_pid" && "$keep" != 1 ]]; then
    kill "$dockerd_pid" 2> /dev/null
    for _ in $(seq 30); do kill -0 "$dockerd_pid" 2> /dev/null || break; sleep 1; done
  fi
  if ((status != 0)) && [[ -f "$work/build.log" && -z "$build_s" ]]; then
    echo "--- last lines of docker build:" >&2
    tail -n 60 "$work/build.log" >&2
  fi
  rm -rf "$work"
  echo "--- disk after:"
  df -h / | tail -n 1
  exit "$status"
}
trap cleanup EXIT

echo "--- disk before:"
df -h / | tail -n 1

phase "Docker engine"
if [[ -z "$docker" ]] || ! "$docker" info > /dev/null 2>&1; then
  if ! command -v dockerd > /dev/null || ! command -v debootstrap > /dev/null; then
    [[ $EUID == 0 ]] || fail "no Docker daemon, and installing one needs root"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io debootstrap \
      > "$work/apt.log" 2>&1 || { tail -n 20 "$work/apt.log" >&2; fail "apt-get install docker.io failed"; }
  fi
  docker=/usr/bin/docker
  # No bridge and no iptables rules: the build and the container use the host's network.
  dockerd --bridge=none --iptables=false --ip-forward=false --ip-masq=false > "$work/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 60); do "$docker" info > /dev/null 2>&1 && break; sleep 0.5; done
  "$docker" info > /dev/null 2>&1 || { tail -n 20 "$work/dockerd.log" >&2; fail "dockerd did not start"; }
fi
"$docker" version --format 'client {{.Client.Version}}, daemon {{.Server.Version}}'

if [[ -z "$base" ]]; then
  phase "Base image (scripts/docker_base.sh)"
  base=mla-serve-base:bookworm
  DOCKER="$docker" scripts/docker_base.sh "$base"
fi

phase "docker build (FROM $base)"
build_start=$SECONDS
DOCKER_BUILDKIT=1 "$docker" build --progress=plain --network host --build-arg "BASE_IMAGE=$base" -t "$image" . \
  > "$work/build.log" 2>&1
# One line per build step: its time, or cached.
awk '{ id = $1 }
  /^#[0-9]+ \[/ && !/\[internal\]/ { n = $0; sub(/^#[0-9]+ /, "", n); name[id] = substr(n, 1, 100); next }
  /^#[0-9]+ (DONE|CACHED)/ && (id in name) && !(id in shown) {
    shown[id] = 1; printf "   %-7s %s\n", ($2 == "CACHED" ? "cached" : $3), name[id] }' "$work/build.log"
build_s=$((SECONDS - build_start))
size="$("$docker" image inspect -f '{{.Size}}' "$image")"
echo "   image: $((size / 1000000)) MB, built in ${build_s}s"

phase "Image contents"
[[ "$("$docker" image inspect -f '{{.Config.User}}' "$image")" == mla ]] || fail "the image does not run as mla"
check "runs as the non-root user mla"
# shellcheck disable=SC2016 # the script runs in the container, its $lib expands there
"$docker" run --rm --network none --entrypoint sh "$image" -c '
  for lib in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    ldconfig -p | grep -q "$lib " || { echo "$lib is not in the loader cache"; exit 1; }
  done
  if ldd /opt/mla-serve/lib/*.so* | grep "not found"; then exit 1; fi
  if ldconfig -p | grep -q libcuda.so; then echo "libcuda is in the image"; exit 1; fi' \
  || fail "CUDA libraries"
check "cuBLAS 13 and NCCL in the loader cache with every dependency; no libcuda (the host's comes in)"

phase "Run the demo model on the CPU"
# Waits until $2/health answers 200 from the host; fails with the log if the container exits.
wait_for_health() {
  for _ in $(seq 120); do
    curl -fsS -m 2 "$2/health" > /dev/null 2>&1 && return 0
    [[ "$("$docker" inspect -f '{{.State.Running}}' "$1")" == true ]] || break
    sleep 0.5
  done
  "$docker" logs "$1" 2>&1 | tail -n 20
  fail "$1: no 200 from $2/health"
}
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# Loopback addresses other than the default 127.0.0.1 show which setting took effect, without
# listening on the machine's other interfaces: here MLA_SERVE_HOST (how the image sets --host's
# default) and --port, later --host. --health-interval only makes the HEALTHCHECK answer sooner.
"$docker" run -d --name "$container" --network host --health-interval 2s -e MLA_SERVE_HOST=127.0.0.2 \
  "$image" --port "$port" > /dev/null
url="http://127.0.0.2:$port"
wait_for_health "$container" "$url"
check "/health is 200 at MLA_SERVE_HOST and the port given with --port (127.0.0.2:$port)"
# --device auto names why it chose the CPU; a binary without kernels would say so instead.
"$docker" logs "$container" > "$work/server.log" 2>&1
grep -q 'using cpu because no NVIDIA GPU is visible' "$work/server.log" \
  || { tail -n 20 "$work/server.log"; fail "the binary in the image was built without CUDA kernels"; }
check "the binary has its CUDA kernels (CPU chosen only for want of a GPU)"
for _ in $(seq 30); do
  [[ "$("$docker" inspect -f '{{.State.Health.Status}}' "$container")" == healthy ]] && break
  sleep 1
done
[[ "$("$docker" inspect -f '{{.State.Health.Status}}' "$container")" == healthy ]] \
  || fail "HEALTHCHECK: $("$docker" inspect -f '{{json .State.Health}}' "$container")"
check "the image's HEALTHCHECK reports healthy"

curl -fsS -m 30 "$url/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}' > "$work/chat.json"
python3 - "$work/chat.json" << 'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
choice = r["choices"][0]
assert r["object"] == "chat.completion" and r["model"] == "demo", r
assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str), r
assert choice["finish_reason"] in ("length", "stop") and 0 < r["usage"]["completion_tokens"] <= 8, r
EOF
check "chat completion: an assistant message, usage counted"
curl -fsS -N -m 30 "$url/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "stream": true}' \
  > "$work/stream.txt"
python3 - "$work/stream.txt" << 'EOF'
import json, sys
events = [l[len("data: "):] for l in open(sys.argv[1]).read().splitlines() if l.startswith("data: ")]
assert events and events[-1] == "[DONE]", events
chunks = [json.loads(e) for e in events[:-1]]
assert all(c["object"] == "chat.completion.chunk" for c in chunks), chunks
assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop"), chunks
EOF
check "streamed chat completion: chunks, a finish reason, [DONE]"

phase "Stop (SIGTERM)"
"$docker" stop -t 30 "$container" > /dev/null
[[ "$("$docker" inspect -f '{{.State.ExitCode}}' "$container")" == 0 ]] \
  || { "$docker" logs "$container" 2>&1 | tail -n 20; fail "exit status after SIGTERM"; }
check "graceful stop, exit status 0"

phase "--host after the image"
"$docker" run -d --name "$container-host" --network host "$image" --host 127.0.0.3 --port "$port" > /dev/null
wait_for_health "$container-host" "http://127.0.0.3:$port"
check "--host wins over the image's MLA_SERVE_HOST (127.0.0.3:$port)"

phase "done: image built in ${build_s}s, $((SECONDS - t0))s in all"
echo "docker: $passed passed, 0 failed"
