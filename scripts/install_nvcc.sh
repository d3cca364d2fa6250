#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler (nvcc + headers, no driver, no GPU libraries) from PyPI
# into .toolchain/cuda of this repository, so that build.rs can compile kernels/*.cu on machines
# without a CUDA toolkit (CI, laptops). Idempotent: a second run with the same pins does nothing.
# Prints the nvcc path on its last line.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${MLA_TOOLCHAIN_DIR:-$repo/.toolchain/cuda}"
python="${PYTHON:-python3}"

# One version per package; nvcc, crt and nvvm must agree, the runtime headers come a patch later.
pins=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-cuda-crt==13.0.88"
  "nvidia-nvvm==13.0.88"
  "nvidia-cuda-runtime==13.0.96"
  "nvidia-cuda-cccl==13.0.85"
)
stamp="$target/.installed-pins"
want="$(printf '%s\n' "${pins[@]}")"
nvcc="$target/nvidia/cu13/bin/nvcc"

if [[ -x "$nvcc" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "nvcc already installed" >&2
else
  rm -rf "$target"
  mkdir -p "$target"
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --target "$target" "${pins[@]}"
  [[ -x "$nvcc" ]] || { echo "error: $nvcc missing after install" >&2; exit 1; }
  printf '%s\n' "${pins[@]}" >"$stamp"
fi

cu="$target/nvidia/cu13"
# nvcc looks for nvvm/, crt headers and libdevice next to its bin/; the wheels spread them over the
# same prefix, so nothing else is needed beyond the include path the runtime wheel provides.
"$nvcc" --version | tail -n 2 >&2
echo "$nvcc"
