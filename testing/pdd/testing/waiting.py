"""Wait for a condition the code exposes, never for an amount of time.

The deadline is a backstop, not a verdict on speed: it is long (three minutes by default)
so that only a broken build reaches it, however loaded the machine. The async form
polls in loop time, so under a virtual clock it is exact and costs nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: Long enough that a loaded 2-core machine never reaches it while the code works: a
#: worker process took 50 s to answer /health with two suites and two busy loops sharing
#: the cores. Below pytest's per-test timeout (300 s), so a real hang still fails there.
DEFAULT_TIMEOUT_S = 180.0


class WaitTimeout(AssertionError):
    """The condition never held: the message names it."""


async def until(
    condition: Callable[[], T | Awaitable[T]],
    what: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    every_s: float = 0.01,
) -> T:
    """Poll ``condition`` (on the event loop) until it returns something truthy; return that.
    ``condition`` may be a coroutine function (a poll over HTTP, say): it is awaited.

    An exception from ``condition`` (say, "the process died") ends the wait at once.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s

    async def check() -> T:
        value = condition()
        return await value if inspect.isawaitable(value) else value  # type: ignore[return-value]

    while not (value := await check()):
        if loop.time() > deadline:
            raise WaitTimeout(f"{what}: not within {timeout_s}s")
        await asyncio.sleep(every_s)
    return value


def until_sync(
    condition: Callable[[], T],
    what: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    every_s: float = 0.05,
) -> T:
    """``until`` for code outside an event loop (polling other processes)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise WaitTimeout(f"{what}: not within {timeout_s}s")
        time.sleep(every_s)
    return value
