"""The WAN link emulator's real-socket faces: the admin endpoint and the ``pdd wan-link`` command.

What the line does to bytes is checked on the in-memory network with a virtual
clock (``test_wan_link``); here only what needs sockets and processes, and nothing
that depends on timing.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pdd.local.cluster import wait_http_ok
from pdd.wan.admin import AdminServer
from pdd.wan.link import WanLink

pytestmark = pytest.mark.integration

#: Only a broken command misses this: the wait ends as soon as the endpoint answers.
READY_DEADLINE_S = 120.0


async def test_admin_re_rates_cuts_and_rejects_bad_requests() -> None:
    async with WanLink("127.0.0.1:0", "127.0.0.1:1", gbps=1) as link:
        admin = AdminServer(link)
        await admin.start("127.0.0.1:0")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin.port}") as http:
            assert (await http.post("/rate", json={"gbps": 0.4})).json()["gbps"] == 0.4
            assert link.forward.gbps == link.reverse.gbps == pytest.approx(0.4)
            assert (await http.post("/partition", json={"cut": True})).json()["cut"] is True
            assert link.is_cut
            assert (await http.post("/rate", json={"gbps": -1})).status_code == 400
            assert (await http.post("/rate", content=b"{not json")).status_code == 400
            assert (await http.post("/partition", json={"cut": "maybe"})).status_code == 400
            assert (await http.get("/rate")).status_code == 405
            assert (await http.get("/nope")).status_code == 404
            stats = (await http.get("/stats")).json()
        assert stats["gbps"] == pytest.approx(0.4) and stats["cut"] is True
        reader, writer = await asyncio.open_connection("127.0.0.1", admin.port)
        writer.write(b"garbage\r\n\r\n")
        assert b"400" in await reader.read()
        writer.close()
        await admin.close()


def test_cli_serves_admin_and_stops_on_sigterm(unused_tcp_port_factory) -> None:
    listen, admin = unused_tcp_port_factory(), unused_tcp_port_factory()
    argv = [
        sys.executable, "-m", "pdd.cli", "wan-link", f"--listen=127.0.0.1:{listen}",
        "--to=127.0.0.1:1", "--link-gbps=2.5", "--link-rtt-ms=30", f"--admin=127.0.0.1:{admin}",
    ]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:

        def alive() -> None:
            assert process.poll() is None, process.stdout.read()  # type: ignore[union-attr]

        url = f"http://127.0.0.1:{admin}/stats"
        assert wait_http_ok(url, time.monotonic() + READY_DEADLINE_S, check_alive=alive)
        stats = httpx.get(url).json()
        assert stats["gbps"] == 2.5 and stats["rtt_ms"] == 30
        reply = httpx.post(f"http://127.0.0.1:{admin}/partition", json={"cut": True})
        assert reply.json()["cut"] is True
        process.send_signal(signal.SIGTERM)
        assert process.wait() == 0
    finally:
        process.kill()
