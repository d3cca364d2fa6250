# mla-serve for NVIDIA GPU nodes.
#
# Build stage: CUDA 13 devel image + Rust. The kernels are compiled exactly as in CI: the pinned
# CUDA 13.0 compiler from PyPI (scripts/install_nvcc.sh, the script scripts/test.sh runs) and
# MLA_REQUIRE_NVCC=1, so a kernel that does not compile fails the image build as it fails CI.
# Run stage: CUDA 13 runtime image (cuBLAS 13; the driver comes from the host via --gpus).
#
#   docker build -t mla-serve .
#   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/data/hf mla-serve \
#       --device cuda --model deepseek-ai/DeepSeek-V2-Lite-Chat
# See docs/docker.md.

ARG CUDA_IMAGE_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_IMAGE_VERSION}-devel-${UBUNTU} AS build
ARG RUST_VERSION=1.95.0
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl build-essential pkg-config python3 python3-pip \
 && rm -rf /var/lib/apt/lists/*
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo PATH=/usr/local/cargo/bin:$PATH
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain ${RUST_VERSION}
# install_nvcc.sh installs into the repository's .toolchain with `pip install --target`, which
# touches no system package; Ubuntu's PEP 668 marker would refuse it otherwise.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
WORKDIR /src
COPY . .
RUN NVCC="$(scripts/install_nvcc.sh)" MLA_REQUIRE_NVCC=1 \
    cargo build --release --locked -p mla-serve \
 && strip target/release/mla-serve \
 && cp target/release/mla-serve /usr/local/bin/mla-serve

FROM nvidia/cuda:${CUDA_IMAGE_VERSION}-runtime-${UBUNTU}
COPY --from=build /usr/local/bin/mla-serve /usr/local/bin/mla-serve
# Hugging Face cache (models given as ORG/NAME are looked up here); mount the host's cache.
ENV HF_HOME=/data/hf
VOLUME ["/data/hf"]
EXPOSE 8000
# Listen on every interface of the container, port 8000; pass everything else as arguments.
ENTRYPOINT ["mla-serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--device", "cuda", "--model", "deepseek-v2-lite", "--load-format", "dummy"]
