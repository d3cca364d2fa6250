#!/usr/bin/env bash
# Runs the whole test suite: every Rust crate's tests (CPU reference, scheduler, server, kernels
# compiled with nvcc), then the end-to-end suite that drives the real binary over HTTP with the
# official OpenAI Python SDK. Installs what it needs (the CUDA compiler from PyPI, the Python test
# dependencies) on first use, so it works on a fresh machine with Rust and Python 3.
#
# GPU tests are marked #[ignore] and run on a GPU machine (see docs/cuda-backend.md).
set -euo pipefail
cd "$(dirname "$0")/.."

# CI machines' disks vary (one run died with "No space left on device" two minutes in): say how
# much there is, and keep the debug build small. Line tables keep backtraces' file:line but drop
# the full debug info, and no incremental caches: together several GB less in target/.
echo "== Disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free in $PWD"
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# Kernels are compiled on every run so CI proves they build; nvcc comes from PyPI if absent.
if [ -x scripts/install_nvcc.sh ]; then
  nvcc_path="$(scripts/install_nvcc.sh)"
  export NVCC="${nvcc_path}"
  export MLA_REQUIRE_NVCC="${MLA_REQUIRE_NVCC:-1}"
fi

echo "== [$((SECONDS))s] House rules (scripts/lint.sh: rustfmt, clang-format, clippy -D warnings, commit subjects, results index)"
scripts/lint.sh

echo "== [$((SECONDS))s] Python test dependencies"
python3 -m pip install --quiet --disable-pip-version-check -r tests/e2e/requirements.txt

echo "== [$((SECONDS))s] Rust tests"
# mla-cuda's integration tests (tests/gpu_*.rs) need a GPU: every one is #[ignore] without it, and
# clippy above already compiles them (every target). Linking their twenty binaries to run nothing
# took minutes of the 2-core CI machine, so here mla-cuda runs only its host-side unit tests;
# scripts/gpu_tests.sh builds and runs the rest on a GPU machine.
#
# Every command selects the whole workspace, so dependencies resolve to the same features and one
# compile serves them all: a separate `cargo build -p mla-serve` (without the dev-dependencies'
# features: hyper's client, rand's std, ...) or `cargo test -p mla-cuda --lib` (without
# mla-server's serde_json features) recompiled every workspace crate and a dozen to a hundred
# dependencies, minutes of the 2-core CI machine. The end-to-end suite runs the binary this build
# leaves.
cargo build --locked --workspace --exclude mla-cuda --bins --tests 2>&1
echo "== [$((SECONDS))s] Rust tests: binaries and integration tests"
cargo test --workspace --locked --exclude mla-cuda --bins --test '*' 2>&1
echo "== [$((SECONDS))s] Rust tests: every crate's unit tests (mla-cuda's host-side ones too)"
cargo test --workspace --locked --lib 2>&1

echo "== [$((SECONDS))s] End-to-end tests (real binary, real HTTP, openai SDK)"
export MLA_SERVE_BIN="${MLA_SERVE_BIN:-$PWD/target/debug/mla-serve}"
python3 -m pytest -q tests/e2e 2>&1
