#!/usr/bin/env bash
# The house rules CI enforces (CONTRIBUTING.md, "Rules of the house"); scripts/test.sh runs this
# first. Installs the pinned clang-format from PyPI into .toolchain/ on first use.
#
#   scripts/lint.sh          check everything
#   scripts/lint.sh --fix    rewrite the formatting in place (Rust and CUDA), then check the rest
set -euo pipefail
cd "$(dirname "$0")/.."

fix=0
[[ "${1:-}" == "--fix" ]] && fix=1

clang_format_pin="clang-format==23.1.5"
cf_dir=".toolchain/clang-format"
cf="$cf_dir/clang_format/data/bin/clang-format"
if [[ ! -x "$cf" || "$(cat "$cf_dir/.installed-pin" 2>/dev/null)" != "$clang_format_pin" ]]; then
  rm -rf "$cf_dir"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$cf_dir" \
    "$clang_format_pin"
  echo "$clang_format_pin" > "$cf_dir/.installed-pin"
fi
cuda_sources=(kernels/*.cu kernels/*.cuh benches/*.cu)

if (( fix )); then
  cargo fmt --all
  "$cf" --style=file -i "${cuda_sources[@]}"
fi

echo "== rustfmt"
cargo fmt --all --check
echo "== clang-format (kernels/, benches/*.cu)"
"$cf" --style=file --dry-run -Werror "${cuda_sources[@]}"
echo "== clippy (-D warnings, every target)"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== import circles between the modules of each crate"
python3 scripts/module_cycles.py
echo "== the maps of the code name only what exists"
python3 scripts/check_doc_map.py docs/architecture.md docs/multi-gpu.md docs/cuda-backend.md docs/metrics.md README.md CONTRIBUTING.md
echo "== commit subjects"
scripts/check_commit_subjects.sh
echo "== benchmark results index (benches/results/README.md against the run folders)"
python3 scripts/results_index.py --check
