"""``pdd bench --chaos``: the seeded schedule, and how a run's failures are counted.

A chaos run against real processes is in test_chaos_bench.py; here the subject is
what must hold whatever the processes do: the same seed gives the same schedule, the
schedule only touches what the mode has, and failures are told apart correctly."""

from __future__ import annotations

import pytest

from pdd.bench import cli as bench
from pdd.bench import report
from pdd.bench.chaos import WAN, plan
from pdd.bench.replay import Outcome
from pdd.local.topology import Counts, mode_workers

pytestmark = pytest.mark.unit

PDD_WORKERS = mode_workers("pdd", Counts(prefill=2, relay=2, main=2))


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    first = plan(7, 6, PDD_WORKERS, wan=True, requests=200)
    assert plan(7, 6, PDD_WORKERS, wan=True, requests=200) == first
    others = {tuple(plan(seed, 6, PDD_WORKERS, wan=True, requests=200)) for seed in range(8)}
    assert len(others) > 1


def test_a_schedule_has_both_kinds_touches_only_what_the_mode_has_and_leaves_a_tail() -> None:
    names = {w.name for w in PDD_WORKERS}
    for seed in range(20):
        schedule = plan(seed, 4, PDD_WORKERS, wan=True, requests=100)
        assert len(schedule) == 4
        assert {e.kind for e in schedule} == {"kill", "cut"}
        for event in schedule:
            if event.kind == "kill":
                assert event.target in names and event.role in ("prefill", "relay", "main")
            else:
                assert (event.target, event.role) == (WAN, WAN)
            assert 10 <= event.after <= 70 and event.lasts >= 1
        assert [e.after for e in schedule] == sorted(e.after for e in schedule)


def test_modes_without_a_wan_or_workers_to_kill_get_what_they_can() -> None:
    samedc = plan(3, 4, mode_workers("samedc", Counts()), wan=False, requests=50)
    assert samedc and {e.kind for e in samedc} == {"kill"}
    assert plan(3, 4, mode_workers("mono", Counts()), wan=False, requests=50) == []
    assert plan(3, 4, PDD_WORKERS, wan=True, requests=1) == []


def test_bench_refuses_a_chaos_run_without_an_untouched_reference_before_starting(capsys) -> None:
    assert bench.main(["--chaos", "--modes", "pdd,naive", "--max-requests", "20"]) == 2
    assert "put mono first (--modes mono,pdd,naive)" in capsys.readouterr().err
    assert bench.main(["--chaos", "--modes", "mono", "--max-requests", "20"]) == 2
    assert "nothing to kill or cut in mono" in capsys.readouterr().err
    assert bench.main(["--chaos", "--scale-down", "main", "--main", "2"]) == 2
    assert "not with --url or --scale-down" in capsys.readouterr().err


def outcome(key: str, sent_at: float, e2e_s: float, kind: str | None = None) -> Outcome:
    o = Outcome(key, prompt_tokens=10, max_tokens=4, sent_at=sent_at, e2e_s=e2e_s)
    if kind is None:
        o.finish_reason = "length"
    else:
        o.fail(kind, f"reason {kind}", "message")  # type: ignore[arg-type]
    return o


def test_failures_are_told_apart_by_how_they_ended_and_whether_anything_could_serve() -> None:
    outcomes = [
        outcome("ok", 0.0, 1.0),
        outcome("in-outage", 4.0, 2.0, "body"),  # sent before the outage, ended in it
        outcome("after-outage", 9.0, 0.5, "frame"),  # the outage was over
        outcome("broken", 5.0, 0.1, "transport"),  # unclean, whenever it happened
        outcome("cut-short", 1.0, 0.1, "incomplete"),
    ]
    run = report.ModeRun("pdd", outcomes, wall_s=10.0, outages=[(5.0, 8.0)])
    run.leaks = {"leaked_blocks": 0, "locked_blocks": 0, "live_requests": 0}
    counted = report.failures(run)
    assert (counted["failed_clean"], counted["failed_no_survivor"]) == (2, 1)
    assert counted["failed_unclean"] == 2
    assert counted["failure_reasons"] == {
        "reason body": 1,
        "reason frame": 1,
        "reason transport": 1,
        "reason incomplete": 1,
    }
    summary = report.summarize(run, report.Slo())
    assert summary["completed"] + summary["failed_clean"] + summary["failed_unclean"] == 5
    table = report.chaos_table([summary])
    assert "| ... of which with no survivor | 1 |" in table
    assert "| leaked KV blocks | 0 |" in table
