"""Shared pieces for transport tests: a small-window config, an in-memory network and an
echo server on it, and WAN TLS material as the operator generates it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from pdd.common.wan_tls import CA_FILE, CERT_FILE, KEY_FILE, WanTls, load_wan_tls
from pdd.operator.builders.wan_tls import WanTlsMaterial, new_wan_tls
from pdd.testing.memory_network import MemoryNetwork
from pdd.testing.waiting import until
from pdd.worker.transport import Channel, LinkDown, MsgType, TransportConfig, serve
from pdd.worker.transport.endpoints import Server

SECRET = "test-secret"
KIB = 1024

#: Small frames and window so flow control engages on kilobytes; short timeouts so a
#: cut link is noticed quickly.
SMALL = TransportConfig(
    max_frame_bytes=8 * KIB,
    chunk_bytes=8 * KIB,
    window_bytes=32 * KIB,
    connect_timeout_s=2.0,
    read_timeout_s=2.0,
    write_timeout_s=2.0,
)


async def echo(channel: Channel) -> None:
    """Answer every frame with the same type and payload until the peer leaves."""
    try:
        while True:
            frame = await channel.recv(timeout_s=None)
            if frame.msg_type == MsgType.CLOSE:
                return
            await channel.send(frame.msg_type, frame.request_id, frame.payload)
    except LinkDown:
        return


@pytest.fixture
def wait_until() -> Callable[..., Awaitable[object]]:
    """``await wait_until(predicate)``: poll (in loop time) until it holds."""
    return lambda predicate: until(predicate, "the condition the test waits for")


@pytest.fixture
def small() -> TransportConfig:
    return SMALL


@pytest.fixture
def secret() -> str:
    return SECRET


@pytest.fixture
def echo_handler() -> Callable[[Channel], Awaitable[None]]:
    return echo


@pytest.fixture
def net() -> MemoryNetwork:
    return MemoryNetwork()


@pytest.fixture
async def echo_server(net: MemoryNetwork) -> AsyncIterator[Server]:
    server = await serve("md", 0, SECRET, echo, name="md-0", config=SMALL, network=net)
    yield server
    await server.close()


def write_tls(folder: Path, cert: str, key: str, ca: str) -> Path:
    """A WAN TLS folder as a mounted Secret lays it out (``tls.crt``, ``tls.key``, ``ca.crt``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, pem in ((CERT_FILE, cert), (KEY_FILE, key), (CA_FILE, ca)):
        (folder / name).write_text(pem)
    return folder


@pytest.fixture
def tls_files() -> Callable[[Path, str, str, str], Path]:
    """``tls_files(folder, cert, key, ca)``: write a WAN TLS folder (see ``write_tls``)."""
    return write_tls


@pytest.fixture(scope="session")
def deployment_tls() -> WanTlsMaterial:
    """The WAN TLS material the operator would generate for a deployment."""
    return new_wan_tls("chat")


@pytest.fixture(scope="session")
def other_tls() -> WanTlsMaterial:
    """Material of another deployment: another CA, another certificate."""
    return new_wan_tls("other")


@pytest.fixture
def tls_of(tmp_path: Path) -> Callable[[WanTlsMaterial], WanTls]:
    """``tls_of(material)``: the worker's contexts loaded from a folder of those files."""

    def load(material: WanTlsMaterial) -> WanTls:
        folder = tmp_path / f"tls-{abs(hash(material.cert))}"
        return load_wan_tls(write_tls(folder, material.cert, material.key, material.ca))

    return load
