"""The link meters over real sockets, through the WAN link emulator on loopback TCP.

Nothing here depends on how fast the machine is: a loaded machine may move fewer bytes
than the line's rate, so goodput is checked against what the line itself forwarded in
the same window (its own count), never above its rate, and RTT against the delay the
line adds (a floor no stall can beat). The exact agreement with the imposed rate is
``test_link_metering`` (virtual clock).
"""

from __future__ import annotations

import asyncio

import pytest

from pdd.wan.link import WanLink
from pdd.worker.transport import (
    Channel,
    MsgType,
    TransportConfig,
    TransportError,
    connect,
    serve,
)
from pdd.worker.transport.link_meter import BUCKETS, LinkKey, LinkMeters
from pdd.worker.transport.metering import ChannelMeter

pytestmark = pytest.mark.integration

KIB = 1024
CONFIG = TransportConfig(max_frame_bytes=64 * KIB, chunk_bytes=64 * KIB, window_bytes=256 * KIB)
RATE_GBPS = 0.016  # 2 MB/s
RATE_BPS = RATE_GBPS * 1e9 / 8
RTT_S = 0.040
WINDOW_S = 2.0
BUSY_S = 3.0
LINK = LinkKey("p-0", "md-0", "prefill", "main")


def attach(channel: Channel, links: LinkMeters, out: LinkKey, sends: bool) -> None:
    now = asyncio.get_running_loop().time()
    channel.attach_meter(ChannelMeter(links.meter(out, now), links.meter(out.reverse, now), sends))


async def test_meters_agree_with_the_line_and_never_beat_its_rate_or_delay(secret: str) -> None:
    loop = asyncio.get_running_loop()
    receiver, sender = LinkMeters(window_s=WINDOW_S), LinkMeters(window_s=WINDOW_S)

    async def consume(channel: Channel) -> None:
        attach(channel, receiver, LINK.reverse, sends=False)
        try:
            while (await channel.recv(timeout_s=None)).msg_type != MsgType.CLOSE:
                pass
        except TransportError:
            pass

    server = await serve("127.0.0.1", 0, secret, consume, name="md-0", config=CONFIG)
    to = f"127.0.0.1:{server.port}"
    async with WanLink("127.0.0.1:0", to, gbps=RATE_GBPS, rtt_ms=RTT_S * 1000) as link:
        channel = await connect("127.0.0.1", link.port, secret, "p-0", config=CONFIG)
        attach(channel, sender, LINK, sends=True)
        start, frame = loop.time(), bytes(CONFIG.chunk_bytes)
        line_at_window_start: int | None = None
        while loop.time() - start < BUSY_S:
            await channel.send(MsgType.KV_CHUNK, 1, frame)
            if line_at_window_start is None and loop.time() - start >= BUSY_S - WINDOW_S:
                line_at_window_start = link.forward.bytes_forwarded
        now = loop.time()
        assert line_at_window_start is not None
        line_bytes = link.forward.bytes_forwarded - line_at_window_start
        got = receiver.meter(LINK, now).snapshot(now)
        sent = sender.meter(LINK, now).snapshot(now)
        await channel.close()
    await server.close()

    # Where the window starts is off by at most a frame sent and a bucket's worth of bytes;
    # what arrives lags what the line wrote by at most a frame or two in socket buffers.
    bucket_bytes = RATE_BPS * WINDOW_S / BUCKETS
    slack = 3 * CONFIG.chunk_bytes + bucket_bytes
    assert got.goodput_bps * WINDOW_S == pytest.approx(line_bytes, abs=slack)
    # The sender counts what the receiver's credit confirmed: behind by at most the window.
    assert sent.goodput_bps * WINDOW_S == pytest.approx(line_bytes, abs=slack + CONFIG.window_bytes)
    # Neither end can read more than the line's rate, nor a round trip under its delay.
    for snap in (sent, got):
        assert snap.goodput_bps <= RATE_BPS + slack / WINDOW_S
        assert snap.rtt_min_s is not None and snap.rtt_min_s >= RTT_S
