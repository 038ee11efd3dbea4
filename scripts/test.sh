#!/usr/bin/env bash
# Set up, start what the tests need (redis-server, which must be installed: this script
# says so and stops when it is not), lint, check layers and types, and run the test suite.
# This is the README's test command and what .ci/run calls. Arguments go to pytest:
#   ./scripts/test.sh -m unit          the inner loop (no processes, no sockets)
#   ./scripts/test.sh -m integration   local processes; -m slow: the long suites
# See docs/testing.md (tiers, determinism, running it on a loaded machine).
set -euo pipefail
cd "$(dirname "$0")/.."

# What the tests need beyond Python: said up front, never installed behind your back
# (CI's .ci/run installs it before calling this script).
if ! command -v redis-server >/dev/null 2>&1; then
  cat >&2 <<'MISSING'
scripts/test.sh: redis-server is not installed; the router's shared-store tests run one.
Install it, then run this again:
  Debian/Ubuntu:  sudo apt-get install redis-server
  Fedora/RHEL:    sudo dnf install redis
  macOS:          brew install redis
MISSING
  exit 1
fi
./scripts/setup.sh

REDIS_PORT=${PDD_TEST_REDIS_PORT:-6399}
redis-server --port "$REDIS_PORT" --save '' --appendonly no --daemonize yes \
  --pidfile "/tmp/pdd-test-redis-$REDIS_PORT.pid" >/dev/null
trap 'kill "$(cat /tmp/pdd-test-redis-'"$REDIS_PORT"'.pid 2>/dev/null)" 2>/dev/null || true' EXIT
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
