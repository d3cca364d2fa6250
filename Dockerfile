# mla-serve for NVIDIA GPU nodes: the release binary with its kernels, cuBLAS 13 and NCCL, on
# Debian bookworm, running as a non-root user. docs/docker.md says how to run it on a GPU node
# and how CI builds it (scripts/docker_ci.sh).
#
#   docker build -t mla-serve .
#   docker run --gpus all --ipc=host -p 8000:8000 -v ~/.cache/huggingface:/data/hf:ro mla-serve \
#       --model deepseek-ai/DeepSeek-V2-Lite-Chat
#
# Built with BuildKit (the default since Docker 23; DOCKER_BUILDKIT=1 before), the legacy builder
# untried. No `# syntax=` line: it would pull a frontend image, and CI reaches no registry.

# Every stage starts from this image: debian:bookworm-slim from a registry, or where there is
# none, the one scripts/docker_base.sh makes from Debian's packages (--build-arg BASE_IMAGE=...).
ARG BASE_IMAGE=debian:bookworm-slim

# ---- toolchain: Rust, a C/C++ compiler (nvcc's host compiler, onig_sys), pip for the wheels.
FROM ${BASE_IMAGE} AS toolchain
# Rust from Debian, not rustup (whose server CI cannot reach): rustc-web/cargo-web are Debian's
# current Rust (1.96 in bookworm-security), where plain rustc (1.63) is older than the
# workspace's rust-version (1.87). cargo refuses a too-old rustc itself, naming both versions.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates cargo-web rustc-web g++ python3 python3-pip \
 && rm -rf /var/lib/apt/lists/*
# pip installs with --target only (below, install_nvcc.sh); Debian's PEP 668 marker would refuse.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src

# ---- cuda-libs: the CUDA libraries mla-serve loads at run time, from NVIDIA's PyPI wheels.
# cuBLAS of CUDA 13.0 (the nvcc release the kernels are compiled with, so any 580+ driver runs
# both), NCCL as tested on the team's multi-GPU machine. cudart is not needed: nothing loads it.
FROM toolchain AS cuda-libs
ARG CUBLAS_VERSION=13.0.2.14
ARG NCCL_VERSION=2.28.3
RUN python3 -m pip install --quiet --no-deps --no-compile --target /tmp/wheels \
      "nvidia-cublas==${CUBLAS_VERSION}" "nvidia-nccl-cu13==${NCCL_VERSION}" \
 && mkdir -p /opt/mla-serve/lib \
 && mv /tmp/wheels/nvidia/cu13/lib/libcublas.so.13 /tmp/wheels/nvidia/cu13/lib/libcublasLt.so.13 \
       /tmp/wheels/nvidia/nccl/lib/libnccl.so.2 /opt/mla-serve/lib/ \
 && rm -rf /tmp/wheels

# ---- recipe: manifests and empty sources (docker/recipe.py). Reruns on every change, but its
# output changes only with a manifest or Cargo.lock, which is what keeps `deps` cached.
FROM toolchain AS recipe
COPY . .
RUN python3 docker/recipe.py /recipe

# ---- build: nvcc, then the dependencies alone (cached until the recipe changes), then the
# workspace.
FROM toolchain AS build
# The pinned nvcc from PyPI, by the script CI runs (scripts/test.sh), into /src/.toolchain/cuda.
COPY scripts/install_nvcc.sh scripts/
RUN scripts/install_nvcc.sh > /dev/null
COPY --from=recipe /recipe ./
RUN cargo build --release --locked -p mla-serve
COPY . .
# The stand-ins above were compiled after the real files were last modified, so cargo would take
# them for up to date: touch the real ones. MLA_REQUIRE_NVCC=1 (as in CI): a kernel that does not
# compile fails the build instead of leaving a binary without kernels.
RUN find crates -name '*.rs' -exec touch {} + \
 && MLA_REQUIRE_NVCC=1 cargo build --release --locked --offline -p mla-serve \
 && strip -o /usr/local/bin/mla-serve target/release/mla-serve

# ---- the image.
FROM ${BASE_IMAGE}
COPY --from=cuda-libs /opt/mla-serve/lib/ /opt/mla-serve/lib/
# The dynamic loader finds cuBLAS and NCCL through ld.so.cache, which the NVIDIA Container Toolkit
# also updates when it mounts the host driver's libcuda.so.1 (never part of the image).
RUN echo /opt/mla-serve/lib > /etc/ld.so.conf.d/mla-serve.conf \
 && ldconfig \
 && useradd --create-home --uid 1000 --user-group mla \
 && mkdir -p /data/hf \
 && chown mla:mla /data/hf
COPY docker/healthcheck.sh /usr/local/bin/mla-serve-healthcheck
COPY --from=build /usr/local/bin/mla-serve /usr/local/bin/mla-serve
# compute,utility: without them the toolkit mounts no libcuda (its default is utility alone).
# NVIDIA_REQUIRE_CUDA makes it refuse a driver older than CUDA 13 at start, with that message.
# MLA_SERVE_HOST: listen on every interface of the container; --host still wins.
# HF_HOME: models named ORG/NAME are looked up in /data/hf/hub; mount the host's cache there.
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=13.0" \
    MLA_SERVE_HOST=0.0.0.0 \
    HF_HOME=/data/hf
USER mla
WORKDIR /home/mla
EXPOSE 8000
# Loading a large checkpoint takes minutes; failures in the start period do not count.
HEALTHCHECK --interval=30s --timeout=10s --start-period=20m --retries=3 CMD ["mla-serve-healthcheck"]
# Every argument of `docker run IMAGE ...` goes to mla-serve: with none it serves the bundled demo
# model on the CPU; --port, --host or any other flag may be given.
ENTRYPOINT ["mla-serve"]
