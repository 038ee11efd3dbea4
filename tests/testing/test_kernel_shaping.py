"""Kernel shaping: pure command builders everywhere, a real tbf veth pair where root allows."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pdd.testing.kernel_shaping import (
    KernelShapingError,
    QdiscStats,
    ShapedLink,
    ShapedLinkSpec,
    parse_qdisc_stats,
    rate_commands,
    setup_commands,
    stats_commands,
    teardown_commands,
)

pytestmark = pytest.mark.integration

# A sink run inside the namespace: prints its port, answers each connection with its byte count.
SINK = """
import asyncio
async def handle(reader, writer):
    total = 0
    while data := await reader.read(1 << 16):
        total += len(data)
    writer.write(str(total).encode()); await writer.drain(); writer.close()
async def main():
    server = await asyncio.start_server(handle, "0.0.0.0", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def test_commands_shape_both_directions() -> None:
    spec = ShapedLinkSpec("wan7", index=7, gbps=0.05)
    commands = setup_commands(spec)
    assert commands[0] == ["ip", "netns", "add", "pdd-wan7"]
    shaped = [argv for argv in commands if argv[0] == "tc"]
    assert {argv[argv.index("dev") + 1] for argv in shaped} == {"wan7h", "wan7n"}
    assert all("50000000bit" in argv for argv in shaped)
    assert all(argv[2] == "replace" or argv[4] == "replace" for argv in rate_commands(spec, 1))
    assert ["ip", "netns", "del", "pdd-wan7"] in teardown_commands(spec)


def test_qdisc_counters_are_read_from_tc_json() -> None:
    text = (
        '[{"kind":"tbf","handle":"8003:","root":true,"options":{"rate":6250000,"burst":131068,'
        '"lat":50000},"bytes":2104000,"packets":1400,"drops":0,"overlimits":211,"requeues":0}]'
    )
    assert parse_qdisc_stats(text) == QdiscStats(6_250_000, 2_104_000, 211, 0)
    assert [argv[:4] for argv in stats_commands(ShapedLinkSpec("wan7", 7, 1))] == [
        ["tc", "-s", "-j", "qdisc"],
        ["tc", "-n", "pdd-wan7", "-s"],
    ]


def test_spec_rejects_names_that_break_interface_limits() -> None:
    with pytest.raises(ValueError, match="at most 11"):
        ShapedLinkSpec("a-very-long-name", index=1, gbps=1)
    with pytest.raises(ValueError, match=r"0\.\.255"):
        ShapedLinkSpec("ok", index=300, gbps=1)


@pytest.fixture
def shaped() -> Iterator[ShapedLink]:
    pid = os.getpid()
    spec = ShapedLinkSpec(f"t{pid % 100000}", index=20 + pid % 200, gbps=0.05)
    try:
        link = ShapedLink(spec).__enter__()
    except KernelShapingError as exc:
        pytest.skip(f"needs root with network namespaces and tbf: {exc}")
    try:
        yield link
    finally:
        link.close()


async def _upload(host: str, port: int, nbytes: int) -> tuple[int, float]:
    reader, writer = await asyncio.open_connection(host, port)
    start = time.monotonic()
    writer.write(bytes(nbytes))
    await writer.drain()
    writer.write_eof()
    count = int(await reader.read())
    writer.close()
    return count, time.monotonic() - start


async def test_kernel_bottleneck_is_shared_and_re_rated(shaped: ShapedLink) -> None:
    """The kernel holds two parallel flows to one rate, and takes a new rate at once.

    Only bounds a slower machine cannot break: the flows never beat the rate (minus the
    bucket's burst), and the kernel's own counters say its bucket held packets back.
    """
    sink = subprocess.Popen(
        shaped.exec_argv([sys.executable, "-c", SINK]), stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(await asyncio.to_thread(sink.stdout.readline))
        host, rate_bps = shaped.spec.ns_ip, 50e6
        forward_before, _ = shaped.stats()
        results = await asyncio.gather(
            _upload(host, port, 1_000_000), _upload(host, port, 1_000_000)
        )
        forward, _ = shaped.stats()
        assert [count for count, _ in results] == [1_000_000, 1_000_000]
        burst = forward.rate_bytes_per_s // 200 + 128 * 1024  # what the bucket lets through
        slowest = max(seconds for _, seconds in results)
        assert 8 * (2_000_000 - burst) / rate_bps <= slowest * 1.05  # shared, never beaten
        assert forward.rate_bytes_per_s == rate_bps / 8
        assert forward.bytes - forward_before.bytes >= 2_000_000
        assert forward.overlimits > forward_before.overlimits  # the bucket held packets back
        shaped.set_rate(0.5)
        assert shaped.stats()[0].rate_bytes_per_s == 0.5e9 / 8
        assert shaped.stats()[1].rate_bytes_per_s == 0.5e9 / 8
        count, _ = await _upload(host, port, 1_000_000)
        assert count == 1_000_000
    finally:
        sink.kill()
        sink.wait()
