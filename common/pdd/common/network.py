"""The network under the transport: where byte streams come from.

Everything above this seam (framing, the handshake, channels, the WAN link
emulator) works on asyncio's ``StreamReader``/``StreamWriter`` pairs and asks a
``Network`` for them. ``TCP`` is the real one (asyncio's sockets); the test
harness's ``pdd.testing.memory_network.MemoryNetwork`` is an in-process one with
injectable delay, loss, pauses and cuts, so protocols can be tested without sockets
and, under a virtual clock, without depending on how fast the machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

StreamPair = tuple[asyncio.StreamReader, asyncio.StreamWriter]
OnConnect = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Listener(Protocol):
    """A listening endpoint; ``close()`` stops accepting (open connections stay)."""

    @property
    def port(self) -> int: ...

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


class Network(Protocol):
    """Opens connections and listens, the way ``asyncio.open_connection``/``start_server`` do.

    A refused or reset connection raises ``ConnectionError`` (an ``OSError``), as sockets do.
    """

    async def open_connection(self, host: str, port: int) -> StreamPair: ...

    async def start_server(self, on_connect: OnConnect, host: str, port: int) -> Listener: ...


class TcpListener:
    """An ``asyncio.Server`` seen as a ``Listener``."""

    def __init__(self, server: asyncio.Server) -> None:
        self._server = server

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        self._server.close()

    async def wait_closed(self) -> None:
        await self._server.wait_closed()


class TcpNetwork:
    """Real sockets (port 0 picks a free port)."""

    async def open_connection(self, host: str, port: int) -> StreamPair:
        return await asyncio.open_connection(host, port)

    async def start_server(self, on_connect: OnConnect, host: str, port: int) -> TcpListener:
        return TcpListener(await asyncio.start_server(on_connect, host, port))


TCP = TcpNetwork()
