"""The WAN link emulator over real loopback sockets.

Rates are kept small (tens to hundreds of Mbit/s) and transfers at 1-2 MB so
each test takes well under a few seconds; throughput checks use wide bands.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from pdd.worker.transport.wan_admin import AdminServer
from pdd.worker.transport.wan_link import WanLink, parse_addr

MB = 1_000_000


@dataclass
class Sink:
    """A TCP server that counts what each connection sent, then answers with the count."""

    port: int = 0
    received: list[int] = field(default_factory=list)
    server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        total = 0
        try:
            while data := await reader.read(1 << 16):
                total += len(data)
            writer.write(str(total).encode())
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            self.received.append(total)
            writer.close()


@pytest.fixture
async def sink() -> AsyncIterator[Sink]:
    sink = Sink()
    sink.server = await asyncio.start_server(sink.handle, "127.0.0.1", 0)
    sink.port = sink.server.sockets[0].getsockname()[1]
    yield sink
    sink.server.close()


async def _upload(port: int, nbytes: int) -> tuple[int, float]:
    """Send ``nbytes``, half-close, wait for the sink's count; returns (count, seconds)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(os.urandom(nbytes))
    await writer.drain()
    writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 30)
    elapsed = time.monotonic() - start
    writer.close()
    return int(answer), elapsed


async def test_counters_match_what_was_sent(sink: Sink) -> None:
    async with WanLink("127.0.0.1:0", f"127.0.0.1:{sink.port}", gbps=0.2) as link:
        count, _ = await _upload(link.port, MB)
        stats = link.stats()
    assert count == MB
    assert stats["forward"]["bytes"] == MB
    assert stats["reverse"]["bytes"] == len(str(MB))
    assert stats["connections"] == {"active": 0, "total": 1, "refused": 0, "reset": 0}


async def test_parallel_transfers_share_one_bottleneck(sink: Sink) -> None:
    rate_bps = 100e6
    async with WanLink("127.0.0.1:0", f"127.0.0.1:{sink.port}", gbps=rate_bps / 1e9) as link:
        results = await asyncio.gather(_upload(link.port, 2 * MB), _upload(link.port, 2 * MB))
    per_flow = [8 * count / seconds for count, seconds in results]
    # Together the flows get the line rate, not twice it ...
    assert 0.5 * rate_bps <= sum(per_flow) <= 1.3 * rate_bps, per_flow
    # ... and neither starves.
    assert min(per_flow) >= 0.25 * rate_bps, per_flow


async def test_round_trip_takes_at_least_the_rtt() -> None:
    finished = asyncio.Event()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()
        finished.set()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with WanLink("127.0.0.1:0", target, gbps=1, rtt_ms=100, jitter_ms=20, seed=7) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        for i in range(20):  # separate small writes: separate chunks, separate jitter draws
            start = time.monotonic()
            message = f"ping {i:03d};".encode()
            writer.write(message)
            echoed = await asyncio.wait_for(reader.readexactly(len(message)), 10)
            assert time.monotonic() - start >= 0.1
            assert echoed == message  # jitter never reorders a connection's bytes
        writer.close()
        await asyncio.wait_for(finished.wait(), 10)
    server.close()


async def test_rate_change_through_admin_takes_effect(sink: Sink) -> None:
    async with WanLink("127.0.0.1:0", f"127.0.0.1:{sink.port}", gbps=0.04) as link:
        admin = AdminServer(link)
        await admin.start("127.0.0.1:0")
        _, slow = await _upload(link.port, MB)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin.port}") as http:
            reply = await http.post("/rate", json={"gbps": 0.4})
            assert reply.status_code == 200
            assert reply.json()["gbps"] == pytest.approx(0.4)
        _, fast = await _upload(link.port, MB)
        await admin.close()
    assert fast < slow / 2, (slow, fast)


async def test_short_cut_stalls_and_heals_without_losing_bytes(sink: Sink) -> None:
    async with WanLink(
        "127.0.0.1:0", f"127.0.0.1:{sink.port}", gbps=0.1, partition_grace_s=30
    ) as link:
        upload = asyncio.create_task(_upload(link.port, 2 * MB))
        await asyncio.sleep(0.05)
        link.partition(True)
        forwarded = link.stats()["forward"]["bytes"]
        await asyncio.sleep(0.3)
        assert link.stats()["forward"]["bytes"] == forwarded  # nothing crosses a cut line
        assert not upload.done()
        link.partition(False)
        count, _ = await asyncio.wait_for(upload, 20)
    assert count == 2 * MB


async def test_admin_rejects_bad_requests(sink: Sink) -> None:
    async with WanLink("127.0.0.1:0", f"127.0.0.1:{sink.port}", gbps=1) as link:
        admin = AdminServer(link)
        await admin.start("127.0.0.1:0")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin.port}") as http:
            assert (await http.post("/rate", json={"gbps": -1})).status_code == 400
            assert (await http.post("/rate", content=b"{not json")).status_code == 400
            assert (await http.post("/partition", json={"cut": "maybe"})).status_code == 400
            assert (await http.get("/rate")).status_code == 405
            assert (await http.get("/nope")).status_code == 404
            stats = (await http.get("/stats")).json()
        reader, writer = await asyncio.open_connection("127.0.0.1", admin.port)
        writer.write(b"garbage\r\n\r\n")
        assert b"400" in await asyncio.wait_for(reader.read(), 10)
        await admin.close()
    assert stats["gbps"] == 1 and stats["cut"] is False


async def test_link_survives_clients_that_misbehave(sink: Sink) -> None:
    async with WanLink("127.0.0.1:0", f"127.0.0.1:{sink.port}", gbps=0.2) as link:
        _, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.close()  # connects and leaves at once
        _, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(os.urandom(100_000))
        writer.transport.abort()  # leaves mid-transfer
        count, _ = await _upload(link.port, MB)
        assert count == MB
    async with WanLink("127.0.0.1:0", "127.0.0.1:1", gbps=0.2) as dead_end:
        reader, _ = await asyncio.open_connection("127.0.0.1", dead_end.port)
        with pytest.raises(ConnectionError):
            if not await asyncio.wait_for(reader.read(), 10):
                raise ConnectionResetError("closed")
        assert dead_end.stats()["connections"]["refused"] == 1


def test_bad_settings_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="is not host:port"):
        parse_addr("localhost")
    with pytest.raises(ValueError, match="must be positive"):
        WanLink("127.0.0.1:0", "127.0.0.1:1", gbps=0)
    with pytest.raises(ValueError, match="must not be negative"):
        WanLink("127.0.0.1:0", "127.0.0.1:1", gbps=1, rtt_ms=-1)
