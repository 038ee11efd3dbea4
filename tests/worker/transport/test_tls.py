"""TLS on the WAN channels, over real loopback sockets, with a wiretap on the line.

What would be a real bug: KV or token IDs readable on the line with TLS on (or TLS
silently not engaged), a peer holding another deployment's certificate (or none)
getting a channel, a plaintext client getting through a TLS port, or a refused
connection that hangs, raises a bare ``ssl`` error or stops the server serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
from collections.abc import Callable

import pytest

from pdd.operator.builders.wan_tls import WanTlsMaterial
from pdd.testing.waiting import until
from pdd.worker.transport import (
    Channel,
    LinkDown,
    MsgType,
    TlsError,
    TransportConfig,
    TransportError,
    WanTls,
    connect,
    encode_token_ids,
    serve,
)
from pdd.worker.transport.endpoints import Server

pytestmark = pytest.mark.integration

#: A byte pattern no TLS record would contain by chance: what a wiretap would look for.
MARKER = b"\xde\xad\xbe\xefPDD-KV-MARKER-0123456789"
KV = MARKER * 2048  # ~70 KB: several frames and TLS records
TOKEN_IDS = [0x7A7A7A7A] * 64  # "zzzz" per id on the wire in plaintext
CLIENT_NAME = "prefill-tapped-0"

LogTail = Callable[[], str]


class Tap:
    """A TCP proxy that keeps every byte it forwards: what a wiretap on the WAN sees."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.forward = bytearray()  # client -> server
        self.backward = bytearray()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def __aenter__(self) -> Tap:
        self._server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        pumps = [
            asyncio.create_task(_pump(reader, up_writer, self.forward)),
            asyncio.create_task(_pump(up_reader, writer, self.backward)),
        ]
        self._tasks.update(pumps)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pumps)


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: bytearray
) -> None:
    try:
        while data := await reader.read(65536):
            seen += data
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


class Sink:
    """A data-plane handler that keeps every payload it receives."""

    def __init__(self) -> None:
        self.payloads: dict[MsgType, bytearray] = {}

    async def __call__(self, channel: Channel) -> None:
        with contextlib.suppress(LinkDown):
            while (frame := await channel.recv(timeout_s=None)).msg_type != MsgType.CLOSE:
                self.payloads.setdefault(frame.msg_type, bytearray()).extend(frame.payload)

    def got(self, msg_type: MsgType) -> bytes:
        return bytes(self.payloads.get(msg_type, b""))


@pytest.fixture
def config(small: TransportConfig) -> TransportConfig:
    # The small window makes several credit round trips; long timeouts are only a backstop.
    return dataclasses.replace(small, read_timeout_s=120, write_timeout_s=120)


@pytest.fixture
def transport_log(caplog: pytest.LogCaptureFixture) -> LogTail:
    caplog.set_level(logging.WARNING, logger="pdd.worker.transport")
    return lambda: caplog.text


@pytest.mark.parametrize("tls_on", [True, False], ids=["tls", "plaintext"])
async def test_kv_and_token_ids_are_unreadable_on_the_line_only_with_tls(
    tls_on: bool, deployment_tls: WanTlsMaterial, tls_of, secret: str, config: TransportConfig
) -> None:
    tls = tls_of(deployment_tls) if tls_on else None
    sink = Sink()
    server = await serve(
        "127.0.0.1", 0, secret, sink, name="md-0", config=config,
        tls=tls.server if tls else None,
    )  # fmt: skip
    try:
        async with Tap(server.port) as tap:
            channel = await connect(
                "127.0.0.1", tap.port, secret, CLIENT_NAME, config=config,
                tls=tls.client if tls else None,
            )  # fmt: skip
            await channel.send_chunked(MsgType.KV_CHUNK, 1, KV)
            ids = encode_token_ids(0, TOKEN_IDS)
            await channel.send(MsgType.TOKEN_IDS, 1, ids)
            await until(
                lambda: sink.got(MsgType.TOKEN_IDS) == ids, "the token IDs to reach the server"
            )
            await channel.close()
            assert sink.got(MsgType.KV_CHUNK) == KV  # intact, whichever way it crossed
            line = bytes(tap.forward)
            assert len(line) > len(KV)  # everything crossed the tapped line
            readable = [MARKER in line, ids in line, CLIENT_NAME.encode() in line]
            assert readable == [not tls_on] * 3
    finally:
        await server.close()


async def test_peers_of_another_ca_are_refused_and_the_server_serves_on(
    deployment_tls: WanTlsMaterial,
    other_tls: WanTlsMaterial,
    tls_of,
    secret: str,
    config: TransportConfig,
    transport_log: LogTail,
) -> None:
    ours: WanTls = tls_of(deployment_tls)
    assert ours.mutual  # the generated certificate allows client use
    server = await serve(
        "127.0.0.1", 0, secret, Sink(), name="md-0", config=config, tls=ours.server
    )
    try:
        stranger = tls_of(other_tls)  # trusts another CA, holds its certificate
        with pytest.raises(TlsError, match="does not chain to the deployment's CA"):
            await connect("127.0.0.1", server.port, secret, "x", config=config, tls=stranger.client)
        # It trusts our CA (it can verify the server) but presents another CA's certificate.
        impostor = tls_of(dataclasses.replace(other_tls, ca=deployment_tls.ca))
        with pytest.raises(TlsError, match="our certificate"):
            await connect("127.0.0.1", server.port, secret, "y", config=config, tls=impostor.client)
        # No client certificate at all, while the server demands one.
        anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        anonymous.check_hostname = False
        anonymous.load_verify_locations(cadata=deployment_tls.ca)
        with pytest.raises(TlsError, match="certificate"):
            await connect("127.0.0.1", server.port, secret, "z", config=config, tls=anonymous)
        # A plaintext client on the TLS port: refused (no downgrade).
        with pytest.raises(TransportError):
            await connect("127.0.0.1", server.port, secret, "plain", config=config)
        await until(lambda: server.stats.rejected == 4, "the server to count 4 rejections")
        assert server.stats.authenticated == 0
        assert transport_log().count("TLS handshake failed") >= 4
        channel = await connect(
            "127.0.0.1", server.port, secret, "p-0", config=config, tls=ours.client
        )
        assert channel.peer.name == "md-0"  # the server serves on
        await channel.close()
    finally:
        await server.close()


async def test_a_tls_client_refuses_a_plaintext_server(
    deployment_tls: WanTlsMaterial, tls_of, secret: str, config: TransportConfig
) -> None:
    server: Server = await serve("127.0.0.1", 0, secret, Sink(), name="md-0", config=config)
    try:
        with pytest.raises(TlsError, match="does not speak TLS"):
            await connect(
                "127.0.0.1", server.port, secret, "p-0", config=config,
                tls=tls_of(deployment_tls).client,
            )  # fmt: skip
        assert server.stats.authenticated == 0
    finally:
        await server.close()
