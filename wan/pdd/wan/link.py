"""A TCP proxy that behaves like one inter-datacenter line (run by ``pdd wan-link``).

Every connection accepted on ``--listen`` is forwarded to ``--to``; more routes
(``Route``: other listen addresses, other targets) can share the same line. All
connections share one bottleneck per direction (see ``bottleneck``), each chunk is
delayed by RTT/2 plus bounded jitter on a delay line (see ``pipe``), and
the line can be re-rated or cut at run time, in-process (``WanLink``) or over
the admin HTTP endpoint (``admin``). A cut stalls every connection; after
``partition_grace_s`` still cut, they are reset, and new ones are refused
(reset at once) until the cut heals. See docs/wan-link.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
import socket
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pdd.common.network import TCP, Listener, Network
from pdd.wan.bottleneck import GBIT, Bottleneck
from pdd.wan.pipe import PathModel, Pipe
from pdd.wan.stats import ConnectionStats, DirectionStats, LinkStats, RouteStats

log = logging.getLogger(__name__)

#: The longest round trip and jitter a line takes, ms: a minute, a hundred times a
#: geostationary satellite's, yet no typo's hours of bytes held on the delay line.
MAX_DELAY_MS = 60_000.0
#: The longest a cut line holds its connections before resetting them, seconds.
MAX_PARTITION_GRACE_S = 3_600.0


def check_bounded(name: str, value: float, high: float, unit: str) -> float:
    """``value`` where it is finite and within [0, high]; ValueError saying the bounds."""
    if not (math.isfinite(value) and 0 <= value <= high):
        raise ValueError(f"{name} must be from 0 to {high:g} {unit}, got {value!r}")
    return value


def parse_addr(text: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); raises ValueError naming the bad address."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {text!r} is not host:port (e.g. 127.0.0.1:7100)")
    return host.strip("[]"), int(port)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), the way a dead middlebox looks to the peer."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(frozen=True)
class Route:
    """Connections accepted on ``listen`` go to ``to``, over the line's shared directions:
    what the client sends on ``forward``, the answers on ``reverse``."""

    listen: str
    to: str

    @classmethod
    def parse(cls, text: str) -> Route:
        """``LISTEN=TO`` (both ``host:port``); raises ValueError naming the bad text."""
        listen, sep, to = text.partition("=")
        if not sep:
            raise ValueError(f"route {text!r} is not LISTEN=TO (e.g. 10.0.0.5:9100=10.1.0.5:9100)")
        parse_addr(listen), parse_addr(to)
        return cls(listen, to)


@dataclass
class ConnectionCounts:
    active: int = 0
    total: int = 0
    refused: int = 0  # arrived while the link was cut, or the far side was unreachable
    reset: int = 0  # torn down by a partition or a peer's reset


class WanLink:
    """The emulator as an object: ``await start()``, ``set_rate()``, ``partition()``, ``stop()``."""

    def __init__(
        self,
        listen: str,
        to: str,
        gbps: float,
        rtt_ms: float = 0.0,
        jitter_ms: float = 0.0,
        *,
        partition_grace_s: float = 5.0,
        seed: int | None = None,
        network: Network = TCP,
        extra_routes: Sequence[Route] = (),
    ) -> None:
        check_bounded("rtt_ms", rtt_ms, MAX_DELAY_MS, "ms")
        check_bounded("jitter_ms", jitter_ms, MAX_DELAY_MS, "ms")
        check_bounded("partition_grace_s", partition_grace_s, MAX_PARTITION_GRACE_S, "s")
        self._routes = (Route(listen, to), *extra_routes)
        for route in self._routes:
            parse_addr(route.listen), parse_addr(route.to)
        self.rtt_ms = rtt_ms
        self.jitter_ms = jitter_ms
        self.partition_grace_s = partition_grace_s
        self.forward = Bottleneck("forward", gbps)  # listen side -> to side
        self.reverse = Bottleneck("reverse", gbps)
        self.connections = ConnectionCounts()
        self._model = PathModel(one_way_s=rtt_ms / 2000, jitter_s=jitter_ms / 1000)
        self._rng = random.Random(seed)
        self._network = network
        self._open = asyncio.Event()
        self._open.set()
        self._servers: list[Listener] = []
        self._tasks: set[asyncio.Task] = set()
        self._reset_timer: asyncio.Task | None = None

    @property
    def port(self) -> int:
        """The port actually listened on (useful with ``listen='127.0.0.1:0'``)."""
        if not self._servers:
            raise RuntimeError("WanLink.port read before start()")
        return self._servers[0].port

    @property
    def is_cut(self) -> bool:
        return not self._open.is_set()

    async def start(self) -> None:
        for route in self._routes:
            server = await self._network.start_server(
                functools.partial(self._on_client, route=route), *parse_addr(route.listen)
            )
            self._servers.append(server)
            log.info("wan-link %s (port %d) -> %s", route.listen, server.port, route.to)

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        if self._reset_timer is not None:
            self._reset_timer.cancel()
        await self._reset_all()

    async def __aenter__(self) -> WanLink:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def set_rate(self, gbps: float) -> None:
        """Re-rate both directions; chunks already on the line keep their slot."""
        self.forward.set_rate(gbps)
        self.reverse.set_rate(gbps)

    def partition(self, cut: bool) -> None:
        """Cut (stall everything, refuse new connections) or heal the line."""
        if cut and not self.is_cut:
            self._open.clear()
            self._reset_timer = asyncio.create_task(self._reset_after_grace())
        elif not cut and self.is_cut:
            self._open.set()
            if self._reset_timer is not None:
                self._reset_timer.cancel()
                self._reset_timer = None

    def stats(self) -> LinkStats:
        """The line's settings and counters now: the very object ``GET /stats`` sends."""
        first = self._routes[0]
        listen = first.listen
        if self._servers:
            listen = f"{parse_addr(first.listen)[0]}:{self.port}"
        return LinkStats(
            listen=listen,
            to=first.to,
            routes=[RouteStats(**asdict(route)) for route in self._routes[1:]],
            gbps=self.forward.gbps,
            rtt_ms=self.rtt_ms,
            jitter_ms=self.jitter_ms,
            cut=self.is_cut,
            connections=ConnectionStats(**asdict(self.connections)),
            forward=_direction_stats(self.forward),
            reverse=_direction_stats(self.reverse),
        )

    async def _reset_after_grace(self) -> None:
        await asyncio.sleep(self.partition_grace_s)
        log.warning("wan-link still cut after %.1fs: resetting connections", self.partition_grace_s)
        await self._reset_all()

    async def _reset_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    async def _on_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, route: Route
    ) -> None:
        if self.is_cut:
            self.connections.refused += 1
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                self._network.open_connection(*parse_addr(route.to)), 10
            )
        except (OSError, TimeoutError) as exc:
            log.warning("wan-link cannot reach %s: %s", route.to, exc)
            self.connections.refused += 1
            _reset(writer)
            return
        task = asyncio.current_task()
        assert task is not None  # asyncio runs connection callbacks as tasks
        self._tasks.add(task)
        self.connections.active += 1
        self.connections.total += 1
        try:
            await self._relay(reader, writer, up_reader, up_writer)
        finally:
            self.connections.active -= 1
            self._tasks.discard(task)

    async def _relay(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        forward = Pipe(reader, up_writer, self.forward, self._model, self._open, self._rng)
        reverse = Pipe(up_reader, writer, self.reverse, self._model, self._open, self._rng)
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(forward.run())
                group.create_task(reverse.run())
        except (asyncio.CancelledError, Exception):
            # A partition, stop() or one side's reset: the other side sees a reset too.
            # Swallowing the cancellation ends this connection task quietly (only
            # stop() and the partition timer cancel it).
            self.connections.reset += 1
            _reset(writer)
            _reset(up_writer)
            return
        writer.close()
        up_writer.close()


def _direction_stats(line: Bottleneck) -> DirectionStats:
    return DirectionStats(
        bytes=line.bytes_forwarded, throughput_gbps=line.meter.bits_per_second() / GBIT
    )
