"""The in-memory network behaves like TCP where the code above relies on it, and its
faults (delay, loss, pause, cut, a crashed host) do exactly what they say, on time."""

from __future__ import annotations

import asyncio

import pytest

from pdd.testing.memory_network import SEGMENT_BYTES, LinkFaults, MemoryNetwork
from pdd.testing.virtual_time import advance
from pdd.testing.waiting import until

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]


async def collect(net: MemoryNetwork, host: str = "b", port: int = 1) -> list[bytes]:
    """A server at host:port that keeps what each connection sent (one entry each)."""
    got: list[bytes] = []

    async def keep(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.read())
        writer.write(b"bye")
        writer.close()

    await net.start_server(keep, host, port)
    return got


async def test_bytes_arrive_in_order_with_eof_and_a_reply() -> None:
    net = MemoryNetwork()
    got = await collect(net)
    reader, writer = await net.open_connection("b", 1)
    data = bytes(range(256)) * 4000  # a million bytes, many segments
    writer.write(data[:1000])
    writer.write(data[1000:])
    await writer.drain()
    writer.write_eof()  # half-close: we can still read
    assert await reader.read() == b"bye"
    assert got == [data]
    assert writer.get_extra_info("peername") == ("b", 1)


async def test_a_reader_that_stops_reading_holds_the_writer_back() -> None:
    net = MemoryNetwork()
    release = asyncio.Event()
    taken = bytearray()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        while chunk := await reader.read(1 << 16):
            taken.extend(chunk)

    await net.start_server(slow, "b", 1)
    _, writer = await net.open_connection("b", 1)
    writer.write(bytes(8 << 20))
    draining = asyncio.create_task(writer.drain())
    await advance(60)  # however long: drain waits for the reader
    assert not draining.done()
    assert writer.transport.get_write_buffer_size() > 7 << 20  # held back, not delivered
    release.set()
    await draining
    writer.close()
    await writer.wait_closed()


async def test_delay_and_loss_shift_delivery_by_exactly_their_time() -> None:
    net = MemoryNetwork()
    net.set_link("b", 1, LinkFaults(delay_s=0.02, loss=0.5, retransmit_s=0.2, seed=3))
    arrivals: list[float] = []

    async def stamp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(SEGMENT_BYTES):
            arrivals.append(asyncio.get_running_loop().time())

    await net.start_server(stamp, "b", 1)
    loop = asyncio.get_running_loop()
    _, writer = await net.open_connection("b", 1)
    assert loop.time() == pytest.approx(0.04)  # connecting takes one round trip
    for _ in range(20):
        writer.write(bytes(SEGMENT_BYTES))
        await advance(0.1)
    delays = [round(t - 0.04 - 0.1 * i, 6) for i, t in enumerate(arrivals)]
    # Every chunk takes the delay; some also wait for a resend (0.22); and a chunk never
    # overtakes the one before it: one sent 0.1 s after a resent one waits for it (0.12).
    assert len(arrivals) == 20 and set(delays) == {0.02, 0.12, 0.22}
    writer.close()


async def test_pause_holds_bytes_and_new_connections_until_resumed() -> None:
    net = MemoryNetwork()
    got = await collect(net)
    path = net.link("b", 1)
    _, writer = await net.open_connection("b", 1)
    writer.write(b"held")
    writer.write_eof()
    path.pause()
    dialing = asyncio.create_task(net.open_connection("b", 1))
    await advance(30)
    assert got == [] and not dialing.done() and path.connections == 1
    path.resume()
    await dialing
    await until(lambda: got, "the held bytes delivered")
    assert got == [b"held"]


async def test_a_cut_resets_both_ends_and_refuses_until_healed() -> None:
    net = MemoryNetwork()
    await collect(net)
    path = net.link("b", 1)
    reader, writer = await net.open_connection("b", 1)
    path.cut()
    with pytest.raises(ConnectionResetError):
        await reader.read()
    with pytest.raises(ConnectionRefusedError):
        await net.open_connection("b", 1)
    path.heal()
    reader, writer = await net.open_connection("b", 1)
    writer.write_eof()
    assert await reader.read() == b"bye"


async def test_abort_is_a_reset_for_the_peer_only() -> None:
    net = MemoryNetwork()
    seen: list[BaseException] = []

    async def wait(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()
        except ConnectionResetError as exc:
            seen.append(exc)

    await net.start_server(wait, "b", 1)
    _, writer = await net.open_connection("b", 1)
    writer.transport.abort()
    await writer.wait_closed()  # the aborting side just closes
    await until(lambda: seen, "the peer hears of the reset")
    assert isinstance(seen[0], ConnectionResetError)


async def test_a_crashed_host_loses_its_connections_and_ports() -> None:
    net = MemoryNetwork()
    await collect(net, "md", 9000)
    p = net.host("p")
    reader, _ = await p.open_connection("md", 9000)  # p -> md
    other_reader, _ = await net.host("q").open_connection("md", 9000)
    net.crash("p")
    with pytest.raises(ConnectionResetError):
        await reader.read()  # p's own connections die with it ...
    assert other_reader.at_eof() is False  # ... and nobody else's
    net.crash("md")
    with pytest.raises(ConnectionResetError):
        await other_reader.read()
    with pytest.raises(ConnectionRefusedError):
        await net.open_connection("md", 9000)


async def test_addresses_are_checked() -> None:
    net = MemoryNetwork()
    with pytest.raises(ConnectionRefusedError, match="nothing listens"):
        await net.open_connection("b", 1)
    listener = await net.start_server(lambda r, w: asyncio.sleep(0), "b", 0)
    with pytest.raises(OSError, match="already in use"):
        await net.start_server(lambda r, w: asyncio.sleep(0), "b", listener.port)
    listener.close()
    with pytest.raises(ConnectionRefusedError):
        await net.open_connection("b", listener.port)
    with pytest.raises(ValueError, match="loss in"):
        LinkFaults(loss=1.0)
