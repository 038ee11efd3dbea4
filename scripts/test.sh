#!/usr/bin/env bash
# Set up (scripts/setup.sh, which also provides a redis-server where the system has
# none), start what the tests need, lint, check layers and types, and run the test suite.
# This is the README's test command and what .ci/run calls. Arguments go to pytest:
#   ./scripts/test.sh -m unit          the inner loop (no processes, no sockets)
#   ./scripts/test.sh -m integration   local processes; -m slow: the long suites
# See docs/testing.md (tiers, determinism, running it on a loaded machine).
# The vLLM tests (the pdd[vllm] extra) then run in .venv-vllm, vLLM's own environment,
# which setup makes: after the whole suite (no arguments, as CI runs it) unless
# PDD_TEST_VLLM=0; with arguments only if PDD_TEST_VLLM=1.
set -euo pipefail
cd "$(dirname "$0")/.."

# The tests that need vLLM installed (each skips, naming the extra, where it is not).
VLLM_TESTS=(tests/worker/vllm)
vllm=${PDD_TEST_VLLM:-auto}
if [ "$vllm" = auto ]; then vllm=$([ "$#" -eq 0 ] && echo 1 || echo 0); fi
if [ "$vllm" = 1 ]; then ./scripts/setup.sh --with-vllm; else ./scripts/setup.sh; fi

# Programs are found on the PATH, then in .venv/bin (after the system's, so a system
# redis-server wins over the one setup installs there), as `pdd up` finds them.
export PATH="$PATH:$PWD/.venv/bin"
REDIS_PORT=${PDD_TEST_REDIS_PORT:-6399}
redis-server --port "$REDIS_PORT" --save '' --appendonly no --daemonize yes \
  --pidfile "$PWD/.venv/test-redis-$REDIS_PORT.pid" >/dev/null
trap 'kill "$(cat .venv/test-redis-'"$REDIS_PORT"'.pid 2>/dev/null)" 2>/dev/null || true' EXIT
export PDD_TEST_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"

.venv/bin/ruff check .
# The layering (pyproject [tool.importlinter]: only the worker loads torch or the worker
# package, pdd.common at the bottom, no import cycles) and the types of every product
# package and of pdd bench (pdd.testing, and bench/'s scripts outside the package, are not
# checked).
.venv/bin/lint-imports --no-cache
.venv/bin/mypy -p pdd.common -p pdd.router -p pdd.operator -p pdd.worker \
  -p pdd.local -p pdd.wan -p pdd.simulator -p pdd.cli -p pdd.bench
# Let Python and pytest cache compiled and assertion-rewritten modules between runs.
unset PYTHONDONTWRITEBYTECODE
set +e
# Two workers (one torch thread each), each module on one worker so its fixtures stay
# single, in the order conftest.py gives (slow modules first); a later -n in "$@" wins
# (-n 0: one process).
.venv/bin/python -m pytest -n "${PDD_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "$@"
rc=$?
# pytest exits 5 when it collected no test: not a failure of the code under test.
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi
if [ "$vllm" = 1 ]; then
  # One process: the modules one after another (a vLLM instance takes about 4 GiB).
  echo "vLLM tests in .venv-vllm: ${VLLM_TESTS[*]}"
  .venv-vllm/bin/python -m pytest -n 0 "${VLLM_TESTS[@]}"
  vllm_rc=$?
  if [ "$rc" -eq 0 ]; then rc=$vllm_rc; fi
fi
exit "$rc"
