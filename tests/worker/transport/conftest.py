"""Shared pieces for transport tests: a small-window config, an in-memory network and an
echo server on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from pdd.testing.waiting import until
from pdd.worker.transport import Channel, LinkDown, MsgType, TransportConfig, serve
from pdd.worker.transport.endpoints import Server
from pdd.worker.transport.memory import MemoryNetwork

SECRET = "test-secret"
KIB = 1024

#: Small frames and window so flow control engages on kilobytes; short timeouts so a
#: cut link is noticed quickly.
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


@pytest.fixture
def wait_until() -> Callable[..., Awaitable[object]]:
    """``await wait_until(predicate)``: poll (in loop time) until it holds."""
    return lambda predicate: until(predicate, "the condition the test waits for")


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
def net() -> MemoryNetwork:
    return MemoryNetwork()


@pytest.fixture
async def echo_server(net: MemoryNetwork) -> AsyncIterator[Server]:
    server = await serve("md", 0, SECRET, echo, name="md-0", config=SMALL, network=net)
    yield server
    await server.close()
