#!/usr/bin/env bash
# Run the README's test command N times (default 5) on a fresh clone while every core is
# kept busy, and print each run's summary: the check that no test depends on machine speed.
#
#   ./scripts/test-under-load.sh [RUNS] [pytest args...]
#
# The load is one busy-looping process per core, niced like any other job (so the suite
# competes with them for every core); the clone is made from this checkout's HEAD, so
# commit first. Logs stay in the printed folder.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
shift || true
work=$(mktemp -d /tmp/pdd-under-load.XXXXXX)
git clone -q . "$work/clone"
echo "fresh clone of $(git rev-parse --short HEAD) in $work/clone; logs in $work"

burners=()
stop_burners() { kill "${burners[@]}" 2>/dev/null || true; }
trap stop_burners EXIT
for _ in $(seq "$(nproc)"); do
  (while :; do :; done) &
  burners+=($!)
done
echo "load: ${#burners[@]} busy loops (one per core)"

failed=0
for i in $(seq "$runs"); do
  start=$(date +%s)
  if (cd "$work/clone" && ./scripts/test.sh "$@") >"$work/run-$i.log" 2>&1; then
    verdict=passed
  else
    verdict=FAILED
    failed=$((failed + 1))
  fi
  summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$work/run-$i.log" | tail -1)
  # Each run draws its own test order; ./scripts/test.sh --randomly-seed=N replays it.
  seed=$(grep -oE 'randomly-seed=[0-9]+' "$work/run-$i.log" | head -1)
  echo "run $i/$runs: $verdict in $(($(date +%s) - start)) s ($seed): $summary"
done
exit $((failed > 0))
