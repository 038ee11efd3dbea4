"""Background tasks that talk to workers over httpx, stopped without leaking sockets.

httpx (through httpcore) closes a response inside anyio cancel scopes with ``shield``
set, so that a cancellation cannot cut the close in half. A bare ``Task.cancel()`` is
not anyio's cancellation and goes through the shield: landing while a finished
response is being closed (the stream's end and the router's stop are often a loop turn
apart), it left the pooled connection marked busy with its socket open, for as long as
the process lived, one per unlucky request (the router's open fds grew 10 -> 109 in a
30-minute soak). A task stopped through its own anyio ``CancelScope`` gets the
cancellation only once it is outside every shield, so the close always completes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import anyio


class StoppableTask:
    """Runs ``coro`` on its own asyncio task; :meth:`stop` cancels it the anyio way.

    A stopped task ends quietly (its result is None, no ``CancelledError``); a stop
    before the task first runs still runs it up to its first await, where it ends."""

    def __init__(self, coro: Coroutine[Any, Any, None], name: str | None = None) -> None:
        self._scope = anyio.CancelScope()
        self.task = asyncio.create_task(self._run(coro), name=name)

    async def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        with self._scope:
            await coro

    def stop(self) -> None:
        self._scope.cancel()

    def done(self) -> bool:
        return self.task.done()
