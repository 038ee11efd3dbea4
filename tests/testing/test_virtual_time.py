"""The virtual clock: time moves only when everything waits, by exactly what is due."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdd.testing.virtual_time import VirtualClockStall, run

pytestmark = pytest.mark.unit


def test_sleeps_cost_no_real_time_and_wake_in_due_order() -> None:
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        woke.append((name, asyncio.get_running_loop().time()))

    async def main() -> float:
        await asyncio.gather(sleeper("late", 3600), sleeper("early", 0.25), sleeper("mid", 60))
        return asyncio.get_running_loop().time()

    started = time.monotonic()
    assert run(main(), start=100.0) == 100.0 + 3600
    assert time.monotonic() - started < 5  # an hour of loop time, in (much) less than that
    assert woke == [("early", 100.25), ("mid", 160.0), ("late", 3700.0)]


def test_timeouts_fire_exactly_when_due_and_not_before_work_that_is_ready() -> None:
    async def main() -> tuple[float, int]:
        loop = asyncio.get_running_loop()
        counted = 0

        async def busy() -> None:  # always runnable: time must not move under it
            nonlocal counted
            for _ in range(1000):
                counted += 1
                await asyncio.sleep(0)

        await asyncio.gather(busy(), asyncio.sleep(0))
        assert loop.time() == 0.0
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 2.5)
        return loop.time(), counted

    assert run(main()) == (2.5, 1000)


def test_a_deadlock_is_reported_instead_of_hanging() -> None:
    async def main() -> None:
        await asyncio.Event().wait()  # nothing will ever set it, and no timer is pending

    with pytest.raises(VirtualClockStall, match="deadlocked"):
        run(main(), stall_s=0.2)
