#!/usr/bin/env bash
# Set up (scripts/setup.sh, which also provides a redis-server where the system has
# none), start what the tests need, lint, check layers and types, and run the test suite.
# This is the README's test command and what .ci/run calls. Arguments go to pytest:
#   ./scripts/test.sh -m unit          the inner loop (no processes, no sockets)
#   ./scripts/test.sh -m integration   local processes; -m slow: the long suites
# See docs/testing.md (tiers, determinism, running it on a loaded machine).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh

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
# package, pdd.common at the bottom, no import cycles) and the types of what the router
# and operator images ship.
.venv/bin/lint-imports --no-cache
.venv/bin/mypy -p pdd.common -p pdd.router -p pdd.operator
# Let Python and pytest cache compiled and assertion-rewritten modules between runs.
unset PYTHONDONTWRITEBYTECODE
set +e
# Two workers (one torch thread each), each module on one worker so its fixtures stay
# single, in the order conftest.py gives (slow modules first); a later -n in "$@" wins
# (-n 0: one process).
.venv/bin/python -m pytest -n "${PDD_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: not a failure of the code under test.
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi
exit "$rc"
