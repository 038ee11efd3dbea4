#!/usr/bin/env bash
# Set up, start what the tests need (redis-server), lint, and run the test suite.
# This is the README's test command and what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

if ! command -v redis-server >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
fi
REDIS_PORT=${PDD_TEST_REDIS_PORT:-6399}
redis-server --port "$REDIS_PORT" --save '' --appendonly no --daemonize yes \
  --pidfile "/tmp/pdd-test-redis-$REDIS_PORT.pid" >/dev/null
trap 'kill "$(cat /tmp/pdd-test-redis-'"$REDIS_PORT"'.pid 2>/dev/null)" 2>/dev/null || true' EXIT
export PDD_TEST_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"

.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: not a failure of the code under test.
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi
exit "$rc"
