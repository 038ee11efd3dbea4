"""``pdd bench --chaos`` for real: a short seeded replay of the bundled agentic sample on
the tiny model (mono as the reference, then pdd with one P, RLD and MD), during which
the WAN line is cut and restored and the prefill worker SIGKILLed and restarted.

Whatever the machine's speed: the schedule is the seed's, both kinds of event ran, every
request is accounted for, every completed one has mono's tokens, nothing broke a
stream, the request caught by the cut completed (the relay carries it), and no worker
holds anything afterwards. The restarted P must come back (the
router counts it ready again) or the run reports a problem. Bringing two stacks up and
restarting a worker takes minutes on a loaded 2-core machine: slow tier."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pdd.bench import cli as bench
from pdd.bench.chaos import plan
from pdd.local.topology import Counts, mode_workers

pytestmark = pytest.mark.slow

REQUESTS, SEED, EVENTS = 20, 1, 2


@pytest.mark.timeout(900)
def test_a_seeded_chaos_replay_loses_no_token_and_leaks_nothing(tmp_path: Path) -> None:
    schedule = plan(SEED, EVENTS, mode_workers("pdd", Counts()), wan=True, requests=REQUESTS)
    assert schedule == plan(SEED, EVENTS, mode_workers("pdd", Counts()), True, REQUESTS)
    # The cut comes first: the kill's restart takes a worker's start-up (tens of seconds
    # here), which could otherwise outlast the replay and leave the cut unrun.
    assert [e.kind for e in schedule] == ["cut", "kill"]
    out = tmp_path / "results.json"
    argv = ["--model", "tiny", "--chaos", "--chaos-seed", str(SEED), "--chaos-events", str(EVENTS),
            "--max-requests", str(REQUESTS), "--out-dir", str(tmp_path), "--json", str(out),
            "--no-plots", "--no-progress",
            # MD lets go of a transfer the cut stopped in 5 s, not the default 30
            "--worker-arg=--transfer-timeout-s=5",
            "--worker-arg=--kv-cache-gib=0.03125"]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    chaos = result["chaos"]["pdd"]
    assert chaos["planned"] == [
        {"kind": e.kind, "target": e.target, "role": e.role, "after": e.after, "lasts": e.lasts}
        for e in schedule
    ]
    ran = chaos["ran"]
    assert [(r["kind"], r["target"]) for r in ran] == [("cut", "wan"), ("kill", "pdd-prefill-0")]
    assert all(r["problem"] is None for r in ran)
    assert ran[1]["ready_s"] is not None and ran[1]["ready_s"] >= ran[1]["undone_s"]
    assert ran[1]["outage"]  # the only P: nothing could prefill meanwhile
    for mode in ("mono", "pdd"):
        summary = result["modes"][mode]
        counted = summary["completed"] + summary["failed_clean"] + summary["failed_unclean"]
        assert counted + summary["skipped"] == summary["requests"] == REQUESTS
        assert summary["failed_unclean"] == 0, summary["failure_reasons"]
        assert summary["mismatches"] == 0
        leaks = result["leaks"][mode]
        assert (leaks["leaked_blocks"], leaks["locked_blocks"], leaks["live_requests"]) == (0, 0, 0)
        assert leaks["workers_checked"] == (1 if mode == "mono" else 3)
    assert result["modes"]["mono"]["completed"] == REQUESTS  # the reference is untouched
    assert result["modes"]["pdd"]["completed"] > 0
    # The one request that finished while the line was cut (the slice is one session:
    # one request at a time) completed: a request the cut fails on MD is retried
    # through the relay, which needs no WAN.
    with (tmp_path / "requests.csv").open() as f:
        finished = [row for row in csv.DictReader(f) if row["mode"] == "pdd"]
    cut = ran[0]
    assert cut["undone_after"] - cut["started_after"] == 1
    assert finished[cut["started_after"]]["error"] == ""
