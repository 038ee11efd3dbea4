"""Both ends of a channel through the WAN link emulator measure what the line imposes.

On the in-memory network with a virtual clock: the emulator serializes at its rate and
delays by its RTT in loop time, and so do the meters' clocks, so the goodput and RTT
read back are the line's own, whatever the machine. The bounds are derived from the
imposed rate and delay: one bucket of the goodput window (2 %) plus the flow-control
window the sender may be ahead at the end, and a zero-jitter line's exact delay.
"""

from __future__ import annotations

import asyncio

import pytest

from pdd.testing.memory_network import MemoryNetwork
from pdd.wan.link import WanLink
from pdd.worker.transport import (
    Channel,
    LinkDown,
    MsgType,
    TransferTimeout,
    TransportConfig,
    TransportError,
    connect,
    serve,
)
from pdd.worker.transport.link_meter import LinkKey, LinkMeters
from pdd.worker.transport.metering import ChannelMeter

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

KIB = 1024
CONFIG = TransportConfig(
    max_frame_bytes=64 * KIB,
    chunk_bytes=64 * KIB,
    window_bytes=256 * KIB,
    connect_timeout_s=1.0,
    read_timeout_s=1.0,
    write_timeout_s=1.0,
)
RATE_GBPS = 0.008  # 1 MB/s
RATE_BPS = RATE_GBPS * 1e9 / 8
RTT_MS = 40.0
WINDOW_S = 5.0
LINK = LinkKey("p-0", "md-0", "prefill", "main")


def attach(channel: Channel, links: LinkMeters, out: LinkKey, sends: bool) -> ChannelMeter:
    now = asyncio.get_running_loop().time()
    meter = ChannelMeter(links.meter(out, now), links.meter(out.reverse, now), sends)
    channel.attach_meter(meter)
    return meter


class Receiver:
    """MD's end: meters the channel (data flows in), then consumes frames until the end."""

    def __init__(self) -> None:
        self.links = LinkMeters(window_s=WINDOW_S)
        self.ended = asyncio.Event()

    async def __call__(self, channel: Channel) -> None:
        attach(channel, self.links, LINK.reverse, sends=False)
        try:
            while (await channel.recv(timeout_s=None)).msg_type != MsgType.CLOSE:
                pass
        except TransportError:
            pass
        finally:
            self.ended.set()


async def test_goodput_and_rtt_are_the_lines_at_both_ends(secret: str) -> None:
    net, loop = MemoryNetwork(), asyncio.get_running_loop()
    receiver = Receiver()
    server = await serve("md", 9000, secret, receiver, name="md-0", config=CONFIG, network=net)
    sender_links = LinkMeters(window_s=WINDOW_S)
    async with WanLink("md:9100", "md:9000", gbps=RATE_GBPS, rtt_ms=RTT_MS, network=net):
        channel = await connect("md", 9100, secret, "p-0", config=CONFIG, network=net)
        attach(channel, sender_links, LINK, sends=True)
        total = int(3 * WINDOW_S * RATE_BPS)  # the line stays busy for three windows
        channel.commit(total)
        assert sender_links.meter(LINK, loop.time()).queued == total
        await channel.send_chunked(MsgType.KV_CHUNK, 1, bytes(total))
        now = loop.time()
        sent = sender_links.meter(LINK, now).snapshot(now)
        got = receiver.links.meter(LINK, now).snapshot(now)
        # Sending 3 windows' worth took the line's time: the rate is the line's, not ours.
        assert now >= total / RATE_BPS - CONFIG.window_bytes / RATE_BPS
        slack = 0.02 * RATE_BPS + CONFIG.window_bytes / WINDOW_S
        assert got.goodput_bps == pytest.approx(RATE_BPS, abs=slack)
        assert sent.goodput_bps == pytest.approx(RATE_BPS, abs=slack)
        assert sent.queued_bytes == 0
        assert 0 < sent.in_flight_bytes <= CONFIG.window_bytes
        # The handshake's round trips crossed the delay line both ways, before any queue.
        for snap in (sent, got):
            assert snap.rtt_min_s == pytest.approx(RTT_MS / 1000, abs=1e-3)
            assert snap.rtt_s == pytest.approx(RTT_MS / 1000, abs=1e-3)
        await channel.close()
        await receiver.ended.wait()
        end = loop.time()
        after = sender_links.meter(LINK, end).snapshot(end)
        assert (after.queued_bytes, after.in_flight_bytes) == (0, 0)
        assert after.failures == {} and after.timeouts == 0
        assert receiver.links.meter(LINK, end).snapshot(end).failures == {}
        idle = end + WINDOW_S + WINDOW_S / 50  # a window later, nothing sent: goodput decays
        assert sender_links.meter(LINK, idle).snapshot(idle).goodput_bps == 0.0
    await server.close()


async def test_cut_line_counts_a_timeout_then_one_failure_per_end(secret: str) -> None:
    net = MemoryNetwork()
    receiver = Receiver()
    server = await serve("md", 9000, secret, receiver, name="md-0", config=CONFIG, network=net)
    sender_links = LinkMeters(window_s=WINDOW_S)
    async with WanLink(
        "md:9100", "md:9000", gbps=RATE_GBPS, rtt_ms=RTT_MS, partition_grace_s=2.5, network=net
    ) as link:
        channel = await connect("md", 9100, secret, "p-0", config=CONFIG, network=net)
        attach(channel, sender_links, LINK, sends=True)
        channel.commit(4_000_000)
        link.partition(True)
        with pytest.raises(TransferTimeout):  # the window fills, no credit comes back
            await channel.send_chunked(MsgType.KV_CHUNK, 1, bytes(4_000_000))
        with pytest.raises(LinkDown):  # past the grace period the line resets it
            await channel.recv(timeout_s=None)
        await receiver.ended.wait()
        now = asyncio.get_running_loop().time()
        sent = sender_links.meter(LINK, now).snapshot(now)
        assert sent.timeouts == 1 and sent.failures == {"link_down": 1}
        assert (sent.queued_bytes, sent.in_flight_bytes) == (0, 0)  # released with the channel
        got = receiver.links.meter(LINK, now).snapshot(now)
        assert got.failures == {"link_down": 1}
        # The other direction carried no transfer: nothing is blamed on it.
        reverse = sender_links.meter(LINK.reverse, now).snapshot(now)
        assert reverse.failures == {} and reverse.timeouts == 0
        await channel.close()
    await server.close()
