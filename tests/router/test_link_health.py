"""The WAN line's condition as the router learns it from transfers (``LinkHealth``)."""

from __future__ import annotations

import logging

import pytest

from pdd.common.vocabulary import LinkFault
from pdd.router.link_health import LinkCondition, LinkHealth, Transition

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watched() -> tuple[LinkHealth, list[Transition], Clock]:
    seen: list[Transition] = []
    clock = Clock()
    return LinkHealth("wan", seen.append, clock), seen, clock


def test_a_failed_transfer_puts_the_line_in_doubt_until_a_later_one_lands() -> None:
    health, seen, clock = watched()
    assert health.condition is LinkCondition.HEALTHY and health.doubt() is None
    before_cut = health.ticket
    health.failed(LinkFault.UNREACHABLE, "p0 could not send the KV to md0")
    assert health.condition is LinkCondition.SUSPECTED_CUT
    assert "suspected_cut" in (health.doubt() or "") and "md0" in (health.doubt() or "")
    # A request routed before the failure, whose KV had crossed, proves nothing now.
    health.delivered(before_cut)
    assert health.condition is LinkCondition.SUSPECTED_CUT
    probe = health.ticket
    clock.now += 7.5
    health.delivered(probe)
    assert health.condition is LinkCondition.HEALTHY and health.doubt() is None
    assert [(t.before, t.after) for t in seen] == [
        (LinkCondition.HEALTHY, LinkCondition.SUSPECTED_CUT),
        (LinkCondition.SUSPECTED_CUT, LinkCondition.HEALTHY),
    ]
    assert seen[1].lasted_s == 7.5


def test_a_failure_after_the_probe_was_routed_voids_that_probe() -> None:
    health, seen, _ = watched()
    health.failed(LinkFault.UNREACHABLE, "cut")
    probe = health.ticket
    health.failed(LinkFault.UNREACHABLE, "still cut")  # another request, same line
    health.delivered(probe)
    assert health.condition is LinkCondition.SUSPECTED_CUT
    assert len(seen) == 1  # the second failure changed nothing but the ticket


def test_a_stall_is_degraded_and_each_change_is_one_transition_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    health, seen, _ = watched()
    with caplog.at_level(logging.INFO, logger="pdd.router.link_health"):
        health.failed(LinkFault.STALLED, "no progress within 30s")
        health.failed(LinkFault.UNREACHABLE, "refused")
        health.delivered(health.ticket)
    assert [t.after for t in seen] == [
        LinkCondition.DEGRADED,
        LinkCondition.SUSPECTED_CUT,
        LinkCondition.HEALTHY,
    ]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "healthy -> degraded" in lines[0]
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 2 + [logging.INFO]
