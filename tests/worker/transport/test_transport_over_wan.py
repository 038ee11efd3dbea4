"""Channels through the WAN link emulator: a cut line ends transfers with a typed outcome.

On the in-memory network with a virtual clock, so each outcome arrives exactly when
its timeout says, and the test can say so.
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

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

#: One-second waits: a cut is noticed quickly.
QUICK = TransportConfig(
    max_frame_bytes=64 * 1024,
    chunk_bytes=64 * 1024,
    window_bytes=256 * 1024,
    connect_timeout_s=1.0,
    read_timeout_s=1.0,
    write_timeout_s=1.0,
)
GRACE_S = 2.5


async def _drain(channel: Channel) -> None:
    """Consume frames until the peer leaves (the receiving end of a KV transfer)."""
    try:
        while (await channel.recv(timeout_s=None)).msg_type != MsgType.CLOSE:
            pass
    except TransportError:
        pass


async def test_cut_link_times_out_then_resets(secret: str) -> None:
    net = MemoryNetwork()
    loop = asyncio.get_running_loop()
    server = await serve("md", 9000, secret, _drain, name="md-0", config=QUICK, network=net)
    async with WanLink(
        "md:9100", "md:9000", gbps=0.05, rtt_ms=10, partition_grace_s=GRACE_S, network=net
    ) as link:
        channel = await connect("md", 9100, secret, "p-0", config=QUICK, network=net)
        await channel.send_chunked(MsgType.KV_CHUNK, 1, bytes(300_000))  # the link works
        link.partition(True)
        cut_at = loop.time()
        with pytest.raises(TransferTimeout):  # the window fills, no credit comes back
            await channel.send_chunked(MsgType.KV_CHUNK, 1, bytes(4_000_000))
        with pytest.raises(TransferTimeout):
            await channel.recv()
        assert loop.time() - cut_at < GRACE_S  # ended by our timeouts, before any reset
        # Past the grace period the line resets the connection: the channel is down.
        with pytest.raises(LinkDown):
            await channel.recv(timeout_s=None)
        assert loop.time() - cut_at == pytest.approx(GRACE_S, abs=0.01)
        # New connections are refused while the line is cut ...
        with pytest.raises((LinkDown, TransferTimeout)):
            await connect("md", 9100, secret, "p-1", config=QUICK, network=net)
        assert link.stats().connections.refused >= 1
        link.partition(False)
        # ... and accepted again once it heals.
        healed = await connect("md", 9100, secret, "p-2", config=QUICK, network=net)
        await healed.send(MsgType.TOKEN_IDS, 2, b"\x00" * 8)
        await healed.close()
        await channel.close()
    await server.close()
