"""Kernel shaping: pure command builders everywhere, a real tbf veth pair where root allows."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pdd.worker.transport.kernel_shaping import (
    KernelShapingError,
    ShapedLink,
    ShapedLinkSpec,
    rate_commands,
    setup_commands,
    teardown_commands,
)

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
    await asyncio.sleep(120)
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
    count = int(await asyncio.wait_for(reader.read(), 30))
    writer.close()
    return count, time.monotonic() - start


async def test_kernel_bottleneck_is_shared_and_re_rated(shaped: ShapedLink) -> None:
    sink = subprocess.Popen(
        shaped.exec_argv([sys.executable, "-c", SINK]), stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(await asyncio.wait_for(asyncio.to_thread(sink.stdout.readline), 30))
        host, rate_bps = shaped.spec.ns_ip, 50e6
        results = await asyncio.gather(
            _upload(host, port, 1_000_000), _upload(host, port, 1_000_000)
        )
        per_flow = [8 * count / seconds for count, seconds in results]
        assert [count for count, _ in results] == [1_000_000, 1_000_000]
        assert 0.5 * rate_bps <= sum(per_flow) <= 1.3 * rate_bps, per_flow
        assert min(per_flow) >= 0.2 * rate_bps, per_flow
        _, slow = await _upload(host, port, 1_000_000)
        shaped.set_rate(0.5)
        _, fast = await _upload(host, port, 1_000_000)
        assert fast < slow / 2, (slow, fast)
    finally:
        sink.kill()
        sink.wait()
