"""Channels through the WAN link emulator: a cut line ends transfers with a typed outcome."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

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
from pdd.worker.transport.wan_link import WanLink

#: One-second waits: a cut is noticed quickly, and the tests bound every wait by far more.
QUICK = TransportConfig(
    max_frame_bytes=64 * 1024,
    chunk_bytes=64 * 1024,
    window_bytes=256 * 1024,
    connect_timeout_s=1.0,
    read_timeout_s=1.0,
    write_timeout_s=1.0,
)


async def _drain(channel: Channel) -> None:
    """Consume frames until the peer leaves (the receiving end of a KV transfer)."""
    try:
        while (await channel.recv(timeout_s=None)).msg_type != MsgType.CLOSE:
            pass
    except TransportError:
        pass


async def test_cut_link_times_out_then_resets(secret: str) -> None:
    server = await serve("127.0.0.1", 0, secret, _drain, name="md-0", config=QUICK)
    async with WanLink(
        "127.0.0.1:0", f"127.0.0.1:{server.port}", gbps=0.05, rtt_ms=10, partition_grace_s=2.5
    ) as link:
        channel = await connect("127.0.0.1", link.port, secret, "p-0", config=QUICK)
        await channel.send_chunked(MsgType.KV_CHUNK, 1, os.urandom(300_000))  # link works
        link.partition(True)
        started = time.monotonic()
        with pytest.raises(TransferTimeout):
            await asyncio.wait_for(
                channel.send_chunked(MsgType.KV_CHUNK, 1, os.urandom(4_000_000)), 20
            )
        with pytest.raises(TransferTimeout):
            await asyncio.wait_for(channel.recv(), 20)
        assert time.monotonic() - started < 10  # ended by our timeouts, long before any hang
        # Past the grace period the line resets the connection: the channel is down.
        with pytest.raises(LinkDown):
            await asyncio.wait_for(channel.recv(timeout_s=None), 20)
        # New connections are refused while the line is cut ...
        with pytest.raises((LinkDown, TransferTimeout)):
            await connect("127.0.0.1", link.port, secret, "p-1", config=QUICK)
        assert link.stats()["connections"]["refused"] >= 1
        link.partition(False)
        # ... and accepted again once it heals.
        healed = await connect("127.0.0.1", link.port, secret, "p-2", config=QUICK)
        await healed.send(MsgType.TOKEN_IDS, 2, b"\x00" * 8)
        await healed.close()
        await channel.close()
    await server.close()


def test_cli_serves_admin_and_stops_on_sigterm(unused_tcp_port_factory) -> None:
    listen, admin = unused_tcp_port_factory(), unused_tcp_port_factory()
    argv = [
        sys.executable,
        "-c",
        "import sys; from pdd.cli import main; sys.exit(main(sys.argv[1:]))",
        "wan-link",
        f"--listen=127.0.0.1:{listen}",
        "--to=127.0.0.1:1",
        "--gbps=2.5",
        "--rtt-ms=30",
        f"--admin=127.0.0.1:{admin}",
    ]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                stats = httpx.get(f"http://127.0.0.1:{admin}/stats", timeout=1).json()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.1)
        assert stats["gbps"] == 2.5 and stats["rtt_ms"] == 30
        reply = httpx.post(f"http://127.0.0.1:{admin}/partition", json={"cut": True}, timeout=5)
        assert reply.json()["cut"] is True
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        process.kill()
