"""The WAN link emulator, run on the in-memory network with a virtual clock.

The emulator's own code (shared bottleneck, delay line, partitions, resets) runs
unchanged; only the sockets and the clock are replaced, so every rate, delay and
stall below is exact to within a chunk, on any machine. The admin endpoint and the
``pdd wan-link`` command, which need real sockets, are in ``test_wan_link_process``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdd.testing.memory_network import MemoryNetwork
from pdd.testing.virtual_time import advance
from pdd.testing.waiting import until
from pdd.wan.link import Route, WanLink, parse_addr
from pdd.wan.stats import ConnectionStats, RouteStats

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

MB = 1_000_000
CHUNK = 64 * 1024  # the delay line's chunk (PathModel.chunk_bytes)
SINK, LINK = ("dc-b", 7000), ("dc-a", 7100)


@dataclass
class Sink:
    """A server that counts what each connection sent, then answers with the count."""

    received: list[int] = field(default_factory=list)

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
async def net() -> AsyncIterator[MemoryNetwork]:
    network = MemoryNetwork()
    sink = Sink()
    await network.start_server(sink.handle, *SINK)
    network.sink = sink  # type: ignore[attr-defined]
    yield network


def wan_link(net: MemoryNetwork, **kwargs: Any) -> WanLink:
    host, port = LINK
    return WanLink(f"{host}:{port}", "dc-b:7000", network=net, **kwargs)  # type: ignore[arg-type]


async def upload(net: MemoryNetwork, nbytes: int) -> tuple[int, float]:
    """Send ``nbytes``, half-close, read the sink's count; returns (count, loop seconds)."""
    loop = asyncio.get_running_loop()
    reader, writer = await net.open_connection(*LINK)
    start = loop.time()
    writer.write(bytes(nbytes))
    await writer.drain()
    writer.write_eof()
    answer = await reader.read()
    elapsed = loop.time() - start
    writer.close()
    return int(answer), elapsed


async def test_counters_match_what_was_sent(net: MemoryNetwork) -> None:
    async with wan_link(net, gbps=0.2) as link:
        count, _ = await upload(net, MB)
        await until(lambda: link.connections.active == 0, "the proxy saw both ends close")
        stats = link.stats()
    assert count == MB
    assert stats.forward.bytes == MB
    assert stats.reverse.bytes == len(str(MB))
    assert stats.connections == ConnectionStats(active=0, total=1, refused=0, reset=0)


async def test_one_transfer_takes_its_serialization_time_plus_one_way_delay(net) -> None:
    rate_bps, rtt_s = 100e6, 0.03
    async with wan_link(net, gbps=rate_bps / 1e9, rtt_ms=rtt_s * 1000):
        count, seconds = await upload(net, 2 * MB)
    serialization = 8 * 2 * MB / rate_bps  # 0.16 s
    # Bytes out: serialization + one way; the count back: one more way (and its few bytes).
    assert count == 2 * MB
    assert serialization + rtt_s <= seconds <= serialization + rtt_s + 0.005


async def test_parallel_transfers_share_one_bottleneck(net: MemoryNetwork) -> None:
    rate_bps = 100e6
    async with wan_link(net, gbps=rate_bps / 1e9) as link:
        results = await asyncio.gather(upload(net, 2 * MB), upload(net, 2 * MB))
        stats = link.stats()
    seconds = [s for _, s in results]
    # Together the flows take the line time of both (not of one: they share it) ...
    both = 8 * 4 * MB / rate_bps
    assert [c for c, _ in results] == [2 * MB, 2 * MB]
    assert all(both - 8 * CHUNK / rate_bps <= s <= both * 1.01 for s in seconds), seconds
    # ... interleaved chunk by chunk: neither finished early, neither starved.
    assert abs(seconds[0] - seconds[1]) <= 2 * 8 * CHUNK / rate_bps
    assert stats.forward.bytes == 4 * MB


async def test_round_trips_take_the_rtt_plus_bounded_jitter_in_order(net) -> None:
    echo_done = asyncio.Event()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()
        echo_done.set()

    await net.start_server(echo, "dc-b", 7001)
    loop = asyncio.get_running_loop()
    async with WanLink(
        "dc-a:7101", "dc-b:7001", gbps=1, rtt_ms=100, jitter_ms=20, seed=7, network=net
    ):
        reader, writer = await net.open_connection("dc-a", 7101)
        trips = []
        for i in range(20):  # separate small writes: separate chunks, separate jitter draws
            start = loop.time()
            message = f"ping {i:03d};".encode()
            writer.write(message)
            assert await reader.readexactly(len(message)) == message  # never reordered
            trips.append(loop.time() - start)
        writer.close()
        await echo_done.wait()
    assert all(0.1 <= t <= 0.1 + 2 * 0.02 + 0.001 for t in trips), trips
    assert len({round(t, 6) for t in trips}) > 10  # the jitter is drawn, not constant


async def test_rate_change_applies_to_the_bytes_still_on_the_line(net: MemoryNetwork) -> None:
    """A chunk that would take minutes at a trickle leaves soon after the rate goes up
    (a test that holds a line at a trickle and then restores it relies on this)."""
    async with wan_link(net, gbps=1e-6) as link:  # one 64 KiB chunk: 524 s at this rate
        sending = asyncio.create_task(upload(net, CHUNK))
        await asyncio.sleep(1.0)  # virtual time: the chunk is on the line
        link.set_rate(0.4)
        count, seconds = await sending
    assert count == CHUNK
    assert 1.0 <= seconds <= 1.01


async def test_rate_change_takes_effect_for_later_transfers(net: MemoryNetwork) -> None:
    async with wan_link(net, gbps=0.04) as link:
        _, slow = await upload(net, MB)
        link.set_rate(0.4)
        _, fast = await upload(net, MB)
    assert slow == pytest.approx(8 * MB / 0.04e9, rel=0.02)
    assert fast == pytest.approx(8 * MB / 0.4e9, rel=0.02)


async def test_short_cut_stalls_and_heals_without_losing_bytes(net: MemoryNetwork) -> None:
    async with wan_link(net, gbps=0.1, partition_grace_s=30) as link:
        transfer = asyncio.create_task(upload(net, 2 * MB))
        await advance(0.05)  # a third of the transfer's line time
        link.partition(True)
        forwarded = link.stats().forward.bytes
        assert 0 < forwarded < 2 * MB
        await advance(20)  # nothing crosses a cut line, however long it stays cut
        assert link.stats().forward.bytes == forwarded and not transfer.done()
        link.partition(False)
        count, seconds = await transfer
    assert count == 2 * MB
    assert 20 < seconds < 20 + 8 * 2 * MB / 0.1e9 + 0.01  # the line time, plus the cut


async def test_long_cut_resets_connections_and_refuses_new_ones_until_healed(net) -> None:
    async with wan_link(net, gbps=0.1, partition_grace_s=2) as link:
        transfer = asyncio.create_task(upload(net, 2 * MB))
        await advance(0.05)
        link.partition(True)
        with pytest.raises(ConnectionResetError):
            await transfer  # reset once the cut outlasts the grace period
        assert link.stats().connections.reset == 1
        reader, _ = await net.open_connection(*LINK)
        with pytest.raises(ConnectionResetError):
            await reader.read()  # accepted by the socket, then reset: refused
        assert link.stats().connections.refused == 1
        link.partition(False)
        count, _ = await upload(net, MB)
    assert count == MB


async def test_link_survives_clients_that_misbehave(net: MemoryNetwork) -> None:
    async with wan_link(net, gbps=0.2) as link:
        _, writer = await net.open_connection(*LINK)
        writer.close()  # connects and leaves at once
        _, writer = await net.open_connection(*LINK)
        writer.write(bytes(100_000))
        writer.transport.abort()  # leaves mid-transfer
        count, _ = await upload(net, MB)
        assert count == MB
        assert link.stats().connections.total == 3
    async with WanLink("dc-a:7200", "dc-b:1", gbps=0.2, network=net) as dead_end:
        reader, _ = await net.open_connection("dc-a", 7200)
        with pytest.raises(ConnectionResetError):
            await reader.read()
        assert dead_end.stats().connections.refused == 1


def test_bad_settings_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="is not host:port"):
        parse_addr("localhost")
    with pytest.raises(ValueError, match="link rate must be from 1e-06 to 10000 Gbit/s"):
        WanLink("127.0.0.1:0", "127.0.0.1:1", gbps=0)
    with pytest.raises(ValueError, match="rtt_ms must be from 0 to 60000 ms"):
        WanLink("127.0.0.1:0", "127.0.0.1:1", gbps=1, rtt_ms=-1)


async def test_routes_share_one_line(net: MemoryNetwork) -> None:
    """Connections of two routes (two far-side servers) meet in one bottleneck."""
    other = Sink()
    await net.start_server(other.handle, "dc-b", 7001)
    rate_bps = 100e6
    route = Route.parse("dc-a:7101=dc-b:7001")
    async with wan_link(net, gbps=rate_bps / 1e9, extra_routes=[route]) as link:

        async def upload_to_other() -> float:
            loop = asyncio.get_running_loop()
            reader, writer = await net.open_connection("dc-a", 7101)
            start = loop.time()
            writer.write(bytes(2 * MB))
            await writer.drain()
            writer.write_eof()
            assert int(await reader.read()) == 2 * MB
            writer.close()
            return loop.time() - start

        (count, first), second = await asyncio.gather(upload(net, 2 * MB), upload_to_other())
        await until(lambda: link.connections.active == 0, "the proxy saw every end close")
        stats = link.stats()
    assert count == 2 * MB and other.received == [2 * MB]
    both = 8 * 4 * MB / rate_bps  # the line time of both uploads: they shared it
    assert all(both - 8 * CHUNK / rate_bps <= s <= both * 1.01 for s in (first, second))
    assert stats.forward.bytes == 4 * MB
    assert stats.routes == [RouteStats(listen="dc-a:7101", to="dc-b:7001")]


def test_route_text_must_name_both_ends() -> None:
    assert Route.parse("10.0.0.5:9100=10.1.0.5:9100").to == "10.1.0.5:9100"
    for bad in ("10.0.0.5:9100", "10.0.0.5=10.1.0.5:9100"):
        with pytest.raises(ValueError, match=r"LISTEN=TO|host:port"):
            Route.parse(bad)
