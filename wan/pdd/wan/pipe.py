"""One direction of one proxied connection: read, cross the bottleneck, delay, deliver.

Two tasks per direction, joined by a byte-bounded delay line:

- ``pump`` reads a chunk from the source socket, waits for the shared
  bottleneck to serialize it, stamps it with a delivery time (departure +
  one-way delay + bounded random jitter, never earlier than the previous
  chunk's, so a connection's bytes stay in order) and queues it;
- ``deliver`` sleeps until each chunk's time and writes it to the far side.

The pump stops reading while the delay line holds more than twice the
bandwidth-delay product, so a receiver that does not read pushes back to the
sender through TCP instead of piling bytes up in the proxy. Both tasks wait
while the link is cut.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from dataclasses import dataclass

from pdd.wan.bottleneck import Bottleneck

_EOF = b""
#: The most line time one read may take to cross the bottleneck, and the least a read may
#: be (an Ethernet MTU). A real line sends packets: a small message is never held behind
#: the serialization of the bytes written after it, which a 64 KiB read would do on a slow
#: line (52 s at 10 kbit/s). At the default 0.05 Gbit/s a read stays ~64 KiB.
READ_QUANTUM_S = 0.01
MIN_READ_BYTES = 1500


@dataclass(frozen=True)
class PathModel:
    """What the path adds on top of the bottleneck (shared by every pipe of a link)."""

    one_way_s: float
    jitter_s: float
    chunk_bytes: int = 64 * 1024


class Pipe:
    """Moves bytes from ``src`` to ``dst`` through ``line``; ``run()`` ends at EOF or error."""

    def __init__(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        line: Bottleneck,
        model: PathModel,
        link_open: asyncio.Event,
        rng: random.Random,
    ) -> None:
        self._src = src
        self._dst = dst
        self._line = line
        self._model = model
        self._link_open = link_open
        self._rng = rng
        self._queue: deque[tuple[float, bytes]] = deque()
        self._queued_bytes = 0
        self._has_items = asyncio.Event()
        self._has_room = asyncio.Event()
        self._last_delivery = 0.0

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def _max_queued(self) -> int:
        delay = self._model.one_way_s + self._model.jitter_s
        return max(1 << 20, int(2 * self._line.bytes_per_s * delay)) + self._model.chunk_bytes

    async def run(self) -> None:
        """Pump and deliver until the source ends; half-closes ``dst`` at a clean EOF."""
        deliver = asyncio.create_task(self._deliver())
        try:
            await self._pump()
            await deliver
        finally:
            deliver.cancel()

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await self._src.read(self._read_bytes())
            if data:
                await self._link_open.wait()
                departed = await self._line.transmit(len(data))
            else:
                departed = loop.time()
            jitter = self._rng.uniform(0.0, self._model.jitter_s) if self._model.jitter_s else 0.0
            due = max(departed + self._model.one_way_s + jitter, self._last_delivery)
            self._last_delivery = due
            await self._wait_for_room()
            self._queue.append((due, data))
            self._queued_bytes += len(data)
            self._has_items.set()
            if not data:
                return

    def _read_bytes(self) -> int:
        """The next read's size: ``chunk_bytes``, less where the line is too slow for it."""
        by_rate = int(self._line.bytes_per_s * READ_QUANTUM_S)
        return max(MIN_READ_BYTES, min(self._model.chunk_bytes, by_rate))

    async def _wait_for_room(self) -> None:
        while self._queued_bytes > self._max_queued():
            self._has_room.clear()
            await self._has_room.wait()

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._has_items.clear()
                await self._has_items.wait()
            due, data = self._queue[0]
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            await self._link_open.wait()
            self._queue.popleft()
            self._queued_bytes -= len(data)
            self._has_room.set()
            if not data:
                if self._dst.can_write_eof():
                    self._dst.write_eof()
                return
            self._dst.write(data)
            await self._dst.drain()
            self._line.delivered(len(data))
