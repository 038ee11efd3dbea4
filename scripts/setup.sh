#!/usr/bin/env bash
# Create .venv and install PDD with everything needed to run and test it.
# Idempotent: a second run only re-checks the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
# torch is pinned (pyproject) to the CPU build that lies on disk.
.venv/bin/python -m pip install -q -e '.[dev]'
