"""Shared pieces for transport tests: a small-window config and a real loopback server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from pdd.worker.transport import Channel, LinkDown, MsgType, TransportConfig, serve
from pdd.worker.transport.endpoints import Server

SECRET = "test-secret"
KIB = 1024

#: Small frames and window so flow control engages on kilobytes; short timeouts so a
#: cut link is noticed quickly (tests assert outcomes, never the exact time taken).
SMALL = TransportConfig(
    max_frame_bytes=8 * KIB,
    chunk_bytes=8 * KIB,
    window_bytes=32 * KIB,
    connect_timeout_s=2.0,
    read_timeout_s=2.0,
    write_timeout_s=2.0,
)


async def echo(channel: Channel) -> None:
    """Answer every frame with the same type and payload until the peer leaves."""
    try:
        while True:
            frame = await channel.recv(timeout_s=None)
            if frame.msg_type == MsgType.CLOSE:
                return
            await channel.send(frame.msg_type, frame.request_id, frame.payload)
    except LinkDown:
        return


async def _wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``predicate`` until true; fail the test past the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.01)


@pytest.fixture
def wait_until() -> Callable[..., Awaitable[None]]:
    return _wait_until


@pytest.fixture
def small() -> TransportConfig:
    return SMALL


@pytest.fixture
def secret() -> str:
    return SECRET


@pytest.fixture
def echo_handler() -> Callable[[Channel], Awaitable[None]]:
    return echo


@pytest.fixture
async def echo_server() -> AsyncIterator[Server]:
    server = await serve("127.0.0.1", 0, SECRET, echo, name="md-0", config=SMALL)
    yield server
    await server.close()
