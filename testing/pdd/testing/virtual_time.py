"""A virtual clock for asyncio: time moves only when every task waits for a timer.

``run(main())`` runs a coroutine on an event loop whose ``time()`` is virtual.
When nothing is ready to run and no I/O is ready, the loop jumps straight to
its next timer instead of sleeping. So ``asyncio.sleep(30)`` costs nothing,
timeouts fire exactly when they are due in loop time, and the order in which
things happen, the time each one takes, depend only on the code, never on how
fast or how busy the machine is.

For code that waits only on the loop's timers and on in-process events (the
in-memory network, an engine stepped on the loop). A real socket or another
thread makes progress outside the loop, where the clock cannot see it, so the
clock would run ahead of it. When nothing at all is scheduled, the loop waits
for real I/O for ``stall_s`` wall-clock seconds, then fails the run with
``VirtualClockStall``: in a closed world that is a deadlock, which a test
should report rather than hang on.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualClockStall(RuntimeError):
    """Every task is waiting, no timer is due and no I/O came: the run cannot go on."""


class VirtualClock:
    """Seconds since an arbitrary start; moves only by ``advance``."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go back ({seconds}s)")
        self._now += seconds


class _VirtualSelector(selectors.BaseSelector):
    """Delegates to a real selector, but turns "sleep until the next timer" into a jump."""

    def __init__(self, clock: VirtualClock, stall_s: float) -> None:
        self._real = selectors.DefaultSelector()
        self._clock = clock
        self._stall_s = stall_s

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list:
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # nothing scheduled: only real I/O could wake us
            ready = self._real.select(self._stall_s)
            if not ready:
                raise VirtualClockStall(
                    f"every task is waiting and no timer is scheduled ({self._stall_s}s of "
                    "real time without I/O): the run is deadlocked"
                )
            return ready
        self._clock.advance(timeout)
        return []


def new_event_loop(clock: VirtualClock, stall_s: float = 30.0) -> asyncio.AbstractEventLoop:
    """A selector event loop whose ``time()`` is ``clock``'s."""
    loop = asyncio.SelectorEventLoop(_VirtualSelector(clock, stall_s))
    loop.time = clock.time  # type: ignore[method-assign]
    loop.virtual_clock = clock  # type: ignore[attr-defined]
    return loop


async def advance(seconds: float) -> None:
    """Let ``seconds`` of virtual time pass; every timer due meanwhile fires, in order.

    The explicit way for a test to say "this much time goes by". It refuses to run
    on a real loop, where the same wait would be a sleep a busy machine stretches.
    """
    if getattr(asyncio.get_running_loop(), "virtual_clock", None) is None:
        raise RuntimeError("advance() needs a virtual-clock loop: mark the test virtual_clock")
    await asyncio.sleep(seconds)


def run(main: Coroutine[Any, Any, T], start: float = 0.0, stall_s: float = 30.0) -> T:
    """Run ``main`` to completion on a virtual-time loop (like ``asyncio.run``)."""
    clock = VirtualClock(start)
    with asyncio.Runner(loop_factory=lambda: new_event_loop(clock, stall_s)) as runner:
        return runner.run(main)
