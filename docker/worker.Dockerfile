# syntax=docker/dockerfile:1
# PDD worker image: the torch inference core, run as `pdd worker` (role prefill|relay|main|mono).
#
# Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t ghcr.io/pdd-project/pdd-worker:0.1.0 .
# torch comes from the PyTorch CPU index by default, which keeps the image a few hundred MB
# instead of several GB. For a CUDA build pass e.g.
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdd
ENV PATH=/opt/pdd/bin:$PATH
# torch first and from its own index: the biggest layer, and the one that changes least.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY common common
COPY worker worker
COPY router router
COPY operator operator
# torch is already satisfied, so the [worker] extra only adds safetensors and numpy.
RUN pip install ".[worker]"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pdd-worker" \
      org.opencontainers.image.description="PDD worker: prefill, relay-decode, main-decode" \
      org.opencontainers.image.source="https://github.com/pdd-project/pdd" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.ref.name="ghcr.io/pdd-project/pdd-worker:0.1.0"
# The CPU kernels (pdd/worker/model/cpu_kernels.cpp) are compiled for the CPU they run
# on, so a worker on a CPU device builds them at its first start (about 40 s) into
# ~/.cache/pdd/extensions; that takes a C++ compiler. Without one the worker runs
# torch's ops (correct, slower). GPU workers never build them.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pdd pdd
COPY --from=build /opt/pdd /opt/pdd
ENV PATH=/opt/pdd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/pdd
ENTRYPOINT ["pdd", "worker"]
