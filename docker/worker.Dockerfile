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
COPY cli cli
COPY common common
COPY worker worker
COPY router router
COPY operator operator
# torch is already satisfied, so the [worker] extra only adds safetensors and numpy.
RUN pip install ".[worker]"
# The CPU kernels (pdd/worker/model/cpu_kernels.cpp), compiled here, at image build
# time, once per variant: each is compiled for an instruction set (not for the
# builder's CPU), so one image serves every CPU family. A worker probes its node's CPU
# at start and loads the widest variant it can run from this cache, without a
# compiler; on a CPU with none of them (or another architecture) it runs torch's ops.
# Drop a variant from the list to build faster (about a minute each).
ARG PDD_CPU_KERNEL_VARIANTS="avx2 avx512 avx512_bf16"
ENV PDD_EXTENSIONS_DIR=/opt/pdd/cpu-kernels
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python -c "from pdd.worker.model.cpu_kernels import main; main()" \
        --variants ${PDD_CPU_KERNEL_VARIANTS} \
    && rm -f /opt/pdd/cpu-kernels/*.lock

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pdd-worker" \
      org.opencontainers.image.description="PDD worker: prefill, relay-decode, main-decode" \
      org.opencontainers.image.source="https://github.com/pdd-project/pdd" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.ref.name="ghcr.io/pdd-project/pdd-worker:0.1.0"
# The prebuilt CPU kernels need only GCC's OpenMP runtime here, not a compiler: the
# image is smaller and a worker never compiles at start. (Building at first start
# instead, e.g. for a variant not listed above: add g++ and point PDD_EXTENSIONS_DIR at
# a writable volume shared by the node's workers; builds there are locked per variant
# with an OS lock that dies with its holder, and a failed build is recorded once.)
# tcmalloc: `pdd worker` starts itself again with it preloaded, as vLLM's CPU backend
# does, so a step's freed activations are reused rather than unmapped and faulted in
# again (PDD_TCMALLOC=off keeps glibc's malloc; docs/engine.md has the figures).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pdd pdd
COPY --from=build /opt/pdd /opt/pdd
ENV PATH=/opt/pdd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PDD_EXTENSIONS_DIR=/opt/pdd/cpu-kernels
USER 10001:10001
WORKDIR /home/pdd
ENTRYPOINT ["pdd", "worker"]
