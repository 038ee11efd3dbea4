"""``pdd bench --scale-down``: which workers it stops, when, and what it records.

The worker's drain itself runs for real in tests/worker/dataplane/test_process_drain.py;
here the processes are stand-ins that record the signal and exit when told to."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from pdd.bench.scale_down import ScaleDown, ScaleDownError, parse_roles, pick_victims
from pdd.common.vocabulary import Role
from pdd.local.supervisor import Child
from pdd.local.topology import Counts, mode_workers

pytestmark = pytest.mark.unit


class DrainingProcess:
    """A Popen stand-in: SIGTERM starts a drain that ends when the test says so."""

    def __init__(self, exit_code: int = 0) -> None:
        self.signals: list[int] = []
        self.exit_code = exit_code
        self.drained = threading.Event()

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def wait(self, timeout: float | None = None) -> int:
        self.drained.wait()
        return self.exit_code


def test_roles_are_parsed_and_checked() -> None:
    assert parse_roles("relay, main,relay") == (Role.RELAY, Role.MAIN)
    assert parse_roles(None) == () and parse_roles("") == ()
    with pytest.raises(ScaleDownError, match="one of prefill, relay, main"):
        parse_roles("relay,mono")


def test_the_newest_worker_of_each_role_is_picked_where_the_mode_has_the_role() -> None:
    counts = Counts(prefill=1, relay=2, main=3)
    picked = pick_victims(mode_workers("pdd", counts), (Role.RELAY, Role.MAIN))
    assert [s.name for s in picked] == ["pdd-relay-1", "pdd-main-2"]
    # naive has no relay: only MD shrinks there; mono has neither
    assert [
        s.name for s in pick_victims(mode_workers("naive", counts), (Role.RELAY, Role.MAIN))
    ] == ["pdd-main-2"]
    assert pick_victims(mode_workers("mono", counts), (Role.RELAY, Role.MAIN)) == []
    with pytest.raises(ScaleDownError, match="at least 2 prefill workers"):
        pick_victims(mode_workers("pdd", counts), (Role.PREFILL,))


def test_sigterm_goes_out_once_after_the_share_and_the_drain_is_recorded(tmp_path: Path) -> None:
    specs = pick_victims(mode_workers("pdd", Counts(relay=2, main=2)), (Role.RELAY, Role.MAIN))
    procs = [DrainingProcess(0), DrainingProcess(1)]
    children: list[Any] = [
        Child(s.name, p, tmp_path / "log") for s, p in zip(specs, procs, strict=True)
    ]
    scale = ScaleDown(list(zip(specs, children, strict=True)), after=3)
    scale.on_outcome()
    scale.on_outcome()
    assert all(p.signals == [] for p in procs)
    assert scale.wait(timeout_s=0.0) == []  # nothing was stopped yet
    scale.on_outcome()
    scale.on_outcome()
    assert all(p.signals == [signal.SIGTERM] for p in procs)  # once, at the third request
    for p in procs:
        p.drained.set()
    stopped = scale.wait(timeout_s=60.0)
    assert [(s.name, s.role, s.after_requests, s.exit_code) for s in stopped] == [
        ("pdd-relay-1", "relay", 3, 0),
        ("pdd-main-1", "main", 3, 1),
    ]
    assert all(s.drain_s is not None and s.drain_s >= 0 for s in stopped)
    assert scale.names == {"pdd-relay-1", "pdd-main-1"}


def test_a_worker_still_draining_is_reported_as_such(tmp_path: Path) -> None:
    [spec] = pick_victims(mode_workers("pdd", Counts(relay=2)), (Role.RELAY,))
    proc = DrainingProcess()
    scale = ScaleDown([(spec, Child(spec.name, proc, tmp_path / "log"))], after=1)  # type: ignore[arg-type]
    scale.on_outcome()
    [stopped] = scale.wait(timeout_s=0.0)
    assert stopped.exit_code is None and "had not exited" in stopped.describe()
    proc.drained.set()


def test_bench_refuses_a_scale_down_the_stack_cannot_do_before_starting_anything(capsys) -> None:
    from pdd.bench import cli as bench

    assert bench.main(["--modes", "mono,pdd", "--scale-down", "relay", "--max-requests", "2"]) == 2
    assert "needs at least 2 relay workers (pass --relay 2)" in capsys.readouterr().err
