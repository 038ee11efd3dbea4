"""Readiness wake-ups: children's events wake their owner's refresh, replays do not, and
cluster B polling backs off to a bound instead of reading every interval forever."""

from __future__ import annotations

import asyncio

import pytest

from pdd.operator.handlers import _reported
from pdd.operator.wakeups import ReadinessWakeups, next_poll_s, snapshot

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

CHILD = ("serving", "qwen-main")


def deployment(ready: int, replicas: int = 3) -> dict:
    return {"spec": {"replicas": replicas}, "status": {"readyReplicas": ready}}


def test_polling_backs_off_while_nothing_changes_and_stays_bounded() -> None:
    waits: list[float] = []
    previous = None
    for changed in (True, False, False, False, False, False, False, False, True, False):
        previous = next_poll_s(previous, changed, first_s=15.0, max_s=300.0)
        waits.append(previous)
    assert waits == [15.0, 30.0, 60.0, 120.0, 240.0, 300.0, 300.0, 300.0, 15.0, 30.0]


async def test_a_readiness_change_wakes_the_owner_and_a_replay_does_not() -> None:
    wakeups = ReadinessWakeups()
    wakeups.watch("uid")
    assert wakeups.child_changed("uid", CHILD, snapshot(deployment(ready=1)))
    await wakeups.wait("uid", asyncio.Future(), timeout_s=None)  # woken: returns
    # kopf replays every object when its watch restarts: the same readiness is no change.
    assert not wakeups.child_changed("uid", CHILD, snapshot(deployment(ready=1)))
    assert wakeups.child_changed("uid", CHILD, snapshot(deployment(ready=3)))
    assert wakeups.child_changed("uid", CHILD, None)  # deleted
    assert not wakeups.child_changed("uid", CHILD, None)


async def test_without_a_wake_up_the_refresh_waits_for_its_poll_or_forever() -> None:
    wakeups = ReadinessWakeups()
    wakeups.watch("uid")
    loop = asyncio.get_running_loop()
    start = loop.time()
    await wakeups.wait("uid", asyncio.Future(), timeout_s=300.0)
    assert loop.time() - start == pytest.approx(300.0)  # virtual time: exact
    forever = asyncio.ensure_future(wakeups.wait("uid", asyncio.Future(), timeout_s=None))
    await asyncio.sleep(3600)  # virtual: an hour with no event
    assert not forever.done()
    wakeups.child_changed("uid", CHILD, snapshot(deployment(ready=2)))
    await forever


async def test_stopping_ends_every_wait() -> None:
    wakeups = ReadinessWakeups()
    stopped: asyncio.Future[None] = asyncio.Future()
    waiting = asyncio.ensure_future(wakeups.wait("uid", stopped, timeout_s=None))
    await asyncio.sleep(0)
    stopped.set_result(None)
    await waiting
    late = asyncio.ensure_future(wakeups.wait("other", asyncio.Future(), timeout_s=None))
    await asyncio.sleep(0)
    wakeups.wake_all()
    await late


def test_only_the_reported_roles_deployments_wake_a_refresh() -> None:
    assert all(_reported(role) for role in ("prefill", "relay", "main", "router"))
    assert not _reported("redis")  # status.roles has no Redis entry: nothing to refresh
    assert not _reported(None)
