"""An in-memory network: TCP-like byte streams between in-process endpoints, faults on demand.

``MemoryNetwork`` has the interface of ``network.TCP``, so servers, channels and
the WAN link emulator run on it unchanged. Each connection is a pair of asyncio
transports handing bytes to each other through the event loop, with the TCP
semantics the code above relies on: bytes arrive in order; ``drain()`` waits
while the peer does not read (a reader that stops reading pushes back on the
writer); ``write_eof`` half-closes; ``close`` delivers what is queued, then EOF;
``abort`` (and a cut) resets, which the peer sees as ``ConnectionResetError``.

Faults belong to a destination address (``network.link(host, port)``) and apply
to both directions of every connection to it:

- ``delay_s``: one-way latency added to every chunk (order is kept);
- ``loss``: the chance that a chunk is lost and resent after ``retransmit_s``.
  TCP hides loss from the application; what it sees is a stall, with every later
  byte waiting behind the lost one, which is what this models;
- ``pause()``/``resume()``: hold every byte, and new connection attempts, until resumed;
- ``cut()``/``heal()``: reset every connection now and refuse new ones until healed.

A process that dials out through ``network.host(name)`` is known by that name, so
``network.crash(name)`` can do to the network what a dead process does: every
connection it had is reset, its listeners are gone, and new connections to it
are refused.

Loss draws come from a seeded generator, and all waiting is on the event loop's
clock, so under a virtual clock (``pdd.testing.virtual_time``) a run's whole
schedule is the same on any machine.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pdd.common.network import OnConnect, StreamPair

Address = tuple[str, int]

#: Writes are cut into pieces of at most this size, like segments, so a reader
#: that stops reading stops the flow within one piece.
SEGMENT_BYTES = 64 * 1024
#: Bytes a writer may have on the path (sent, not yet delivered) before ``drain()``
#: waits: what a TCP send buffer plus the peer's receive window hold.
_HIGH_WATER = 4 * 1024 * 1024
_LOW_WATER = 1024 * 1024
_STREAM_LIMIT = 64 * 1024
_EOF = None


@dataclass
class LinkFaults:
    """What the path to one address does to the bytes on it; change it at any time."""

    delay_s: float = 0.0
    loss: float = 0.0
    retransmit_s: float = 0.2
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _open: asyncio.Event = field(init=False, repr=False)
    _cut: bool = field(default=False, init=False)
    _connections: set[_Connection] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.retransmit_s < 0 or not 0 <= self.loss < 1:
            raise ValueError("delay_s and retransmit_s must be >= 0 and loss in [0, 1)")
        self._rng = random.Random(self.seed)
        self._open = asyncio.Event()
        self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @property
    def is_cut(self) -> bool:
        return self._cut

    @property
    def connections(self) -> int:
        """Connections to this address that are open now."""
        return len(self._connections)

    def pause(self) -> None:
        """Hold every byte in both directions (connections stay up) until ``resume()``."""
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def cut(self) -> None:
        """Reset every connection now; refuse new ones until ``heal()``."""
        self._cut = True
        for connection in list(self._connections):
            connection.reset(ConnectionResetError("the link was cut"))

    def heal(self) -> None:
        self._cut = False

    def extra_delay(self) -> float:
        """Latency for the next chunk: the delay, plus a resend where the chunk is lost."""
        lost = self.loss > 0 and self._rng.random() < self.loss
        return self.delay_s + (self.retransmit_s if lost else 0.0)

    async def wait_open(self) -> None:
        await self._open.wait()


class _Flow:
    """One direction of a connection: chunks queued with a due time, delivered in order."""

    def __init__(self, sender: _End, receiver: _End, faults: LinkFaults) -> None:
        self.sender = sender
        self.receiver = receiver
        self.faults = faults
        self.buffered = 0  # bytes written, not yet delivered
        self._queue: deque[tuple[float, bytes | None]] = deque()
        self._wake = asyncio.Event()
        self._last_due = 0.0
        self._stopped = False
        self._task: asyncio.Task | None = None

    def push(self, data: bytes | None) -> None:
        if self._stopped:
            return
        loop = asyncio.get_running_loop()
        due = max(loop.time() + self.faults.extra_delay(), self._last_due)
        self._last_due = due
        self._queue.append((due, data))
        self.buffered += len(data) if data else 0
        self._wake.set()
        if self._task is None:
            self._task = loop.create_task(self._deliver())

    def stop(self) -> None:
        """Drop whatever is still queued (a reset)."""
        self._stopped = True
        self._queue.clear()
        self.buffered = 0
        self._wake.set()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopped:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            due, data = self._queue[0]
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            await self.faults.wait_open()
            await self.receiver.wait_reading()
            if self._stopped:
                return  # reset while we waited
            self._queue.popleft()
            if data is _EOF:
                self.receiver.on_eof()
                self.sender.on_eof_delivered()
                return
            self.buffered -= len(data)
            self.sender.on_drained()
            self.receiver.on_data(data)


class _End(asyncio.Transport):
    """One side's transport: writes go out on ``out``, ``on_data`` feeds the protocol."""

    def __init__(self, connection: _Connection, local: Address, peer: Address) -> None:
        super().__init__()
        self._connection = connection
        self._local = local
        self._peer = peer
        self._protocol: asyncio.BaseProtocol | None = None
        self.out: _Flow | None = None
        self._reading = asyncio.Event()
        self._reading.set()
        self._closing = False
        self._eof_written = False
        self._writing_paused = False
        self._lost = False
        self._high, self._low = _HIGH_WATER, _LOW_WATER

    def attach(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol
        protocol.connection_made(self)

    # --- asyncio.Transport ----------------------------------------------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self._peer, "sockname": self._local}.get(name, default)

    def is_closing(self) -> bool:
        return self._closing or self._lost

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol

    def is_reading(self) -> bool:
        return self._reading.is_set()

    def pause_reading(self) -> None:
        self._reading.clear()

    def resume_reading(self) -> None:
        self._reading.set()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high = _HIGH_WATER if high is None else high
        self._low = self._high // 4 if low is None else low

    def get_write_buffer_size(self) -> int:
        return self.out.buffered if self.out is not None else 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self._eof_written or self._lost or self.out is None:
            return  # like a socket transport after close: the bytes go nowhere
        view = memoryview(data).cast("B")
        for offset in range(0, len(view), SEGMENT_BYTES):
            self.out.push(bytes(view[offset : offset + SEGMENT_BYTES]))
        if not self._writing_paused and self.out.buffered > self._high:
            self._writing_paused = True
            self._call_protocol("pause_writing")

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def write_eof(self) -> None:
        if self._eof_written or self._lost or self.out is None:
            return
        self._eof_written = True
        self.out.push(_EOF)

    def can_write_eof(self) -> bool:
        return True

    def close(self) -> None:
        """Deliver what is queued, then EOF; the protocol hears ``connection_lost`` after."""
        if self._closing or self._lost:
            return
        self._closing = True
        if self._eof_written:  # EOF already queued or sent: we are done once it is out
            if self.out is None or not self.out.buffered:
                self.lose(None)
            return
        self._eof_written = True
        if self.out is None:
            self.lose(None)
        else:
            self.out.push(_EOF)

    def abort(self) -> None:
        self._connection.reset(ConnectionResetError("connection reset by peer"), origin=self)

    # --- called by the flows and the connection -------------------------------------------------
    async def wait_reading(self) -> None:
        await self._reading.wait()

    def on_data(self, data: bytes) -> None:
        if not (self._closing or self._lost):
            self._call_protocol("data_received", data)

    def on_eof(self) -> None:
        if self._closing or self._lost:
            return
        keep_open = self._call_protocol("eof_received")
        if not keep_open:
            self.close()

    def on_drained(self) -> None:
        if self._writing_paused and self.out is not None and self.out.buffered <= self._low:
            self._writing_paused = False
            self._call_protocol("resume_writing")

    def on_eof_delivered(self) -> None:
        self.on_drained()
        if self._closing:
            self.lose(None)

    def lose(self, exc: Exception | None) -> None:
        """The end is gone: tell the protocol once."""
        if self._lost:
            return
        self._lost = True
        self._reading.set()  # release a flow waiting on us
        self._connection.end_lost()
        self._call_protocol("connection_lost", exc)

    def _call_protocol(self, method: str, *args: Any) -> Any:
        if self._protocol is None:
            return None
        return getattr(self._protocol, method)(*args)


class _Connection:
    """Two ends and the two flows between them, registered with the link's faults."""

    def __init__(
        self, client: Address, server: Address, faults: LinkFaults, registry: set[_Connection]
    ) -> None:
        self.hosts = {client[0], server[0]}
        self.faults = faults
        self._registry = registry
        self.client = _End(self, client, server)
        self.server = _End(self, server, client)
        self.client.out = _Flow(self.client, self.server, faults)
        self.server.out = _Flow(self.server, self.client, faults)
        faults._connections.add(self)
        registry.add(self)

    def reset(self, exc: Exception, origin: _End | None = None) -> None:
        """Drop every queued byte; ``origin`` (an abort) hears no error, the other side does."""
        for end in (self.client, self.server):
            assert end.out is not None
            end.out.stop()
        for end in (self.client, self.server):
            end.lose(None if end is origin else exc)

    def end_lost(self) -> None:
        if self.client.is_closing() and self.server.is_closing():
            self.faults._connections.discard(self)
            self._registry.discard(self)


class MemoryListener:
    """A listening address of a ``MemoryNetwork``."""

    def __init__(self, network: MemoryNetwork, address: Address, on_connect: OnConnect) -> None:
        self._network = network
        self.address = address
        self.on_connect = on_connect
        self.closed = False
        self.accepted = 0

    @property
    def port(self) -> int:
        return self.address[1]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._network._listeners.pop(self.address, None)

    async def wait_closed(self) -> None:
        return None


class MemoryNetwork:
    """Addresses are any ``host:port``; nothing touches a socket."""

    def __init__(self) -> None:
        self._listeners: dict[Address, MemoryListener] = {}
        self._links: dict[Address, LinkFaults] = {}
        self._connections: set[_Connection] = set()
        self._crashed: set[str] = set()
        self._ports = itertools.count(20000)
        self._client_ports = itertools.count(40000)

    def link(self, host: str, port: int) -> LinkFaults:
        """The faults of the path to ``host:port`` (created on first use, no faults)."""
        return self._links.setdefault((host, port), LinkFaults())

    def set_link(self, host: str, port: int, faults: LinkFaults) -> LinkFaults:
        """Give the path to ``host:port`` these faults (open connections keep the old ones)."""
        self._links[(host, port)] = faults
        return faults

    def host(self, name: str) -> HostNetwork:
        """This network as seen from host ``name``: its outgoing connections carry its name."""
        return HostNetwork(self, name)

    def crash(self, name: str) -> None:
        """What a dead process does to the network: reset its connections, drop its listeners,
        refuse new connections to it (for good: a restarted process is a new host)."""
        self._crashed.add(name)
        for address in [a for a in self._listeners if a[0] == name]:
            self._listeners.pop(address).closed = True
        for connection in [c for c in self._connections if name in c.hosts]:
            connection.reset(ConnectionResetError(f"{name} died"))

    async def start_server(self, on_connect: OnConnect, host: str, port: int) -> MemoryListener:
        if host in self._crashed:
            raise OSError(99, f"{host} has crashed")
        if port == 0:
            port = next(p for p in self._ports if (host, p) not in self._listeners)
        address = (host, port)
        if address in self._listeners:
            raise OSError(98, f"address {host}:{port} is already in use")
        listener = MemoryListener(self, address, on_connect)
        self._listeners[address] = listener
        return listener

    async def open_connection(self, host: str, port: int, source: str = "client") -> StreamPair:
        address = (host, port)
        faults = self.link(host, port)
        self._refuse_if_unreachable(address, faults)
        await faults.wait_open()  # a paused path holds the connection attempt
        if faults.delay_s:
            await asyncio.sleep(2 * faults.delay_s)  # SYN out, SYN-ACK back
        listener = self._refuse_if_unreachable(address, faults)
        loop = asyncio.get_running_loop()
        if source in self._crashed:
            raise ConnectionAbortedError(f"{source} has crashed")
        client = (source, next(self._client_ports))
        connection = _Connection(client, address, faults, self._connections)
        listener.accepted += 1
        server_reader = asyncio.StreamReader(limit=_STREAM_LIMIT, loop=loop)
        connection.server.attach(
            asyncio.StreamReaderProtocol(server_reader, listener.on_connect, loop=loop)
        )
        reader = asyncio.StreamReader(limit=_STREAM_LIMIT, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        connection.client.attach(protocol)
        return reader, asyncio.StreamWriter(connection.client, protocol, reader, loop)

    def _refuse_if_unreachable(self, address: Address, faults: LinkFaults) -> MemoryListener:
        if faults.is_cut or address[0] in self._crashed:
            raise ConnectionRefusedError(f"{address[0]}:{address[1]} is cut off")
        listener = self._listeners.get(address)
        if listener is None:
            raise ConnectionRefusedError(f"nothing listens on {address[0]}:{address[1]}")
        return listener


class HostNetwork:
    """A ``MemoryNetwork`` from one host's side: what it dials is known to come from it."""

    def __init__(self, network: MemoryNetwork, name: str) -> None:
        self.network = network
        self.name = name

    async def open_connection(self, host: str, port: int) -> StreamPair:
        return await self.network.open_connection(host, port, source=self.name)

    async def start_server(self, on_connect: OnConnect, host: str, port: int) -> MemoryListener:
        return await self.network.start_server(on_connect, host, port)
