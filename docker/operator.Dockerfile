# syntax=docker/dockerfile:1
# PDD operator image: the kopf operator that reconciles PDDDeployments, run as `pdd operator`.
#
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/pdd-project/pdd-operator:0.1.0 .
# The base package only: the `pdd` command (cli/), pdd.common and pdd.operator, plus the
# simulator's torch-free planner that the operator runs (pdd.simulator.planner: the loop and
# the scenarios' step model), no worker code and no torch (the layering contracts in
# pyproject.toml keep it so; `pdd` loads components lazily).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdd
ENV PATH=/opt/pdd/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY cli cli
COPY common common
COPY operator operator
COPY simulator simulator
RUN pip install .

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pdd-operator" \
      org.opencontainers.image.description="PDD operator: PDDDeployment to Deployments, Services and HPA" \
      org.opencontainers.image.source="https://github.com/pdd-project/pdd" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.ref.name="ghcr.io/pdd-project/pdd-operator:0.1.0"
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pdd pdd
COPY --from=build /opt/pdd /opt/pdd
ENV PATH=/opt/pdd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/pdd
ENTRYPOINT ["pdd", "operator"]
