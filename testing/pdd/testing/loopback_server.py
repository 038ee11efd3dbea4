"""A TCP server on loopback for tests that script a worker's side of the wire byte by
byte (the router's own HTTP transport, its pools, its streams): the kernel picks the
port, a subclass answers each connection in ``serve``."""

from __future__ import annotations

import asyncio


class LoopbackServer:
    """Listens on 127.0.0.1 from ``start`` to ``stop``; ``url`` is its ``http://`` address."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None, "not started"
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)

    async def stop(self) -> None:
        """Stop listening; the connections already open stay to their handlers."""
        assert self.server is not None, "not started"
        self.server.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
