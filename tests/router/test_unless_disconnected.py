"""``unless_disconnected``: the work for a client is cancelled the moment it disconnects,
and left alone (its result or its error returned as they are) when it does not."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from pdd.router.disconnect import unless_disconnected
from pdd.router.errors import InvalidRequestError

pytestmark = pytest.mark.unit


class Channel:
    """An ASGI receive channel fed by the test; counts who waits on it."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[dict] = asyncio.Queue()
        self.waiting = 0

    async def receive(self) -> dict:
        self.waiting += 1
        try:
            return await self.messages.get()
        finally:
            self.waiting -= 1


async def test_the_work_is_cancelled_once_the_client_disconnects():
    channel = Channel()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def generation() -> str:
        started.set()
        try:
            await asyncio.Event().wait()  # a long generation: it would never end by itself
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    task = asyncio.create_task(unless_disconnected(channel.receive, generation()))
    await started.wait()
    channel.messages.put_nowait({"type": "http.disconnect"})
    with pytest.raises(ClientDisconnect):
        await task
    assert cancelled.is_set()


async def test_work_that_ends_first_keeps_its_result_or_its_error():
    channel = Channel()

    async def answer() -> str:
        await asyncio.sleep(0)  # a loop turn: the listener starts
        assert channel.waiting == 1  # and listens while the work runs
        return "answer"

    async def refused() -> str:
        raise InvalidRequestError("bad")

    assert await unless_disconnected(channel.receive, answer()) == "answer"
    with pytest.raises(InvalidRequestError):
        await unless_disconnected(channel.receive, refused())
    await asyncio.sleep(0)  # the listeners' cancellation lands
    assert channel.waiting == 0
