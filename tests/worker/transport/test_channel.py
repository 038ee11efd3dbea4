"""Channels: auth, rejection, flow control, failures.

On the in-memory network with a virtual clock (the same framing, handshake and
channel code as over TCP; ``test_channel_tcp`` checks the real-socket path), so
timeouts fire exactly when due and no outcome depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from pdd.testing.memory_network import MemoryNetwork
from pdd.testing.virtual_time import advance
from pdd.worker.transport import (
    AuthError,
    ByteCounters,
    Channel,
    LinkDown,
    MsgType,
    TransferTimeout,
    TransportConfig,
    connect,
    decode_error,
    decode_token_ids,
    encode_token_ids,
    endpoints,
    serve,
)
from pdd.worker.transport.counters import ByteCounters as _Counters
from pdd.worker.transport.framing import HEADER_SIZE, Frame, encode_frame, read_frame
from pdd.worker.transport.peer_auth import client_handshake
from pdd.worker.transport.stream import FrameStream

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

HOST = "md"


async def _raw_authenticated(net: MemoryNetwork, port: int, secret: str, config: TransportConfig):
    """A client that passed the handshake but writes raw bytes from then on."""
    reader, writer = await net.open_connection(HOST, port)
    stream = FrameStream(reader, writer, _Counters(), 2.0)
    await client_handshake(stream, secret.encode(), "raw", config.window_bytes, 4096)
    return reader, writer


async def _frames_until_eof(reader: asyncio.StreamReader) -> list[Frame]:
    frames = []
    while (frame := await read_frame(reader, 1 << 20)) is not None:
        frames.append(frame)
    return frames


async def test_authenticated_round_trip(net, echo_server, secret, small) -> None:
    channel = await connect(HOST, echo_server.port, secret, "rld-0", config=small, network=net)
    assert channel.peer.name == "md-0"
    await channel.send(MsgType.TOKEN_IDS, 42, encode_token_ids(100, [5, 6, 7]))
    frame = await channel.recv()
    assert (frame.msg_type, frame.request_id) == (MsgType.TOKEN_IDS, 42)
    assert decode_token_ids(frame.payload).ids == [5, 6, 7]
    await channel.close()
    assert echo_server.stats.authenticated == 1


async def test_wrong_secret_is_rejected_and_server_keeps_serving(
    net, echo_server, secret, small, wait_until
) -> None:
    with pytest.raises(AuthError, match="shared secret"):
        await connect(HOST, echo_server.port, "wrong", "intruder", config=small, network=net)
    await wait_until(lambda: echo_server.stats.rejected == 1)
    channel = await connect(HOST, echo_server.port, secret, "rld-0", config=small, network=net)
    await channel.send(MsgType.ACK, 1)
    assert (await channel.recv()).msg_type == MsgType.ACK
    await channel.close()


async def test_server_that_cannot_prove_the_secret_is_refused_by_the_client(net, secret, small):
    impostor = await serve(
        HOST, 0, "other-secret", lambda ch: ch.close(), config=small, network=net
    )
    try:
        with pytest.raises(AuthError, match="failed to prove the shared secret"):
            await connect(HOST, impostor.port, secret, "rld-0", config=small, network=net)
    finally:
        await impostor.close()


async def test_garbage_and_silent_peers_are_dropped(net, echo_server, secret, small) -> None:
    reader, writer = await net.open_connection(HOST, echo_server.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 64)
    frames = await _frames_until_eof(reader)  # the server answers and closes
    assert decode_error(frames[-1].payload).code == "auth_failed"
    writer.close()
    # A peer that connects and says nothing is dropped after connect_timeout_s.
    silent_reader, silent_writer = await net.open_connection(HOST, echo_server.port)
    assert await silent_reader.read() != b"x"  # EOF after connect_timeout_s
    silent_writer.close()
    assert echo_server.stats.rejected == 2
    channel = await connect(HOST, echo_server.port, secret, "ok", config=small, network=net)
    await channel.close()


@pytest.mark.parametrize(
    ("name", "proof"),
    [
        ("forger", "\u00e9" * 64),  # not ASCII: hmac.compare_digest raised TypeError on it
        ("forger", 7),  # not a string
        ("\ud800", "00" * 32),  # a lone surrogate in JSON: no UTF-8 for the proof's message
    ],
    ids=["non-ascii-proof", "number-proof", "surrogate-name"],
)
async def test_a_malformed_handshake_is_refused_and_closed(
    net, echo_server, secret, small, name, proof
) -> None:
    reader, writer = await net.open_connection(HOST, echo_server.port)
    hello = {"name": name, "nonce": "00" * 32, "window": 1 << 20}
    writer.write(encode_frame(Frame(MsgType.HELLO, 0, 0, json.dumps(hello).encode())))
    writer.write(encode_frame(Frame(MsgType.AUTH, 0, 1, json.dumps({"proof": proof}).encode())))
    frames = await _frames_until_eof(reader)  # answered and closed, not left open
    assert decode_error(frames[-1].payload).code == "auth_failed"
    writer.close()
    assert (echo_server.stats.rejected, echo_server.stats.handler_errors) == (1, 0)
    channel = await connect(HOST, echo_server.port, secret, "ok", config=small, network=net)
    await channel.close()


async def test_a_bug_in_the_handshake_closes_the_connection_and_is_logged(
    net, echo_server, secret, small, monkeypatch, caplog
) -> None:
    real = endpoints.server_handshake

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(endpoints, "server_handshake", broken)
    reader, writer = await net.open_connection(HOST, echo_server.port)
    with pytest.raises(ConnectionResetError):  # closed at once, not left open for ever
        await asyncio.wait_for(reader.read(), small.connect_timeout_s * 10)
    writer.close()
    assert echo_server.stats.handler_errors == 1
    assert "transport handler failed" in caplog.text
    monkeypatch.setattr(endpoints, "server_handshake", real)
    channel = await connect(HOST, echo_server.port, secret, "ok", config=small, network=net)
    await channel.close()


@pytest.mark.parametrize(
    "bad",
    [
        encode_frame(Frame(MsgType.META, 0, 3, b"{}"))[:-2] + b"\x00\x00",  # wrong seq
        b"JUNK" + bytes(HEADER_SIZE - 4),  # bad magic
        encode_frame(Frame(MsgType.HELLO, 0, 2, b"{}")),  # handshake frame after handshake
    ],
    ids=["sequence", "magic", "hello-after-auth"],
)
async def test_malformed_frame_after_auth_closes_only_that_channel(
    net, echo_server, secret, small, bad: bytes
) -> None:
    reader, writer = await _raw_authenticated(net, echo_server.port, secret, small)
    writer.write(bad)
    frames = await _frames_until_eof(reader)
    assert decode_error(frames[-1].payload).code == "malformed_frame"
    writer.close()
    assert echo_server.stats.transport_errors == 1
    channel = await connect(HOST, echo_server.port, secret, "ok", config=small, network=net)
    await channel.send(MsgType.ACK, 9)
    assert (await channel.recv()).request_id == 9
    await channel.close()


async def test_peer_overrunning_its_window_is_cut_off(net, secret, small, wait_until) -> None:
    received: list[Channel] = []

    async def hoard(channel: Channel) -> None:  # never reads: the window fills up
        received.append(channel)
        await asyncio.Event().wait()  # holds the channel, never reads

    server = await serve(HOST, 0, secret, hoard, config=small, network=net)
    reader, writer = await _raw_authenticated(net, server.port, secret, small)
    chunk = bytes(small.max_frame_bytes)
    per_frame = HEADER_SIZE + len(chunk)
    for seq in range(2, 2 + small.window_bytes // per_frame + 1):  # one frame past the window
        writer.write(encode_frame(Frame(MsgType.KV_CHUNK, 1, seq, chunk)))
    frames = await _frames_until_eof(reader)
    assert "overran its flow-control window" in decode_error(frames[-1].payload).message
    await wait_until(lambda: not received[0].is_open)
    assert received[0].buffered_bytes <= small.window_bytes
    writer.close()
    await server.close()


async def test_slow_reader_holds_the_sender_to_the_window(net, secret, small, wait_until) -> None:
    server_side: list[Channel] = []
    release = asyncio.Event()
    got = bytearray()

    async def slow_reader(channel: Channel) -> None:
        server_side.append(channel)
        await release.wait()
        while (frame := await channel.recv()).msg_type == MsgType.KV_CHUNK:
            got.extend(frame.payload)
        await channel.send(MsgType.ACK, frame.request_id)

    server = await serve(HOST, 0, secret, slow_reader, config=small, network=net)
    client = await connect(HOST, server.port, secret, "p-0", config=small, network=net)
    data = os.urandom(40 * small.window_bytes)
    handshake = client.counters.payload_sent  # HELLO + AUTH

    async def transfer() -> None:
        await client.send_chunked(MsgType.KV_CHUNK, 7, data)
        await client.send(MsgType.KV_DONE, 7)

    sending = asyncio.create_task(transfer())
    await wait_until(lambda: client.in_flight_bytes > small.window_bytes - HEADER_SIZE - 8192)
    await advance(1.0)  # time for a sender that ignored the window to run ahead
    assert not sending.done()
    assert client.in_flight_bytes <= small.window_bytes
    assert server_side[0].buffered_bytes <= small.window_bytes
    assert client.counters.payload_sent <= handshake + small.window_bytes

    release.set()
    await sending
    sent = client.counters.payload_sent
    assert (await client.recv()).msg_type == MsgType.ACK
    assert bytes(got) == data
    # Both ends count the same bytes; beyond the data only 8-byte CREDIT payloads were sent.
    assert server_side[0].counters.payload_received == sent
    assert (sent - handshake - len(data)) % 8 == 0
    assert client.counters.framing_sent == client.counters.frames_sent * HEADER_SIZE
    await client.close()
    await server.close()


async def test_sender_times_out_when_credit_never_comes(net, secret, small) -> None:
    async def stuck(channel: Channel) -> None:
        await asyncio.Event().wait()  # holds the channel, never reads

    server = await serve(HOST, 0, secret, stuck, config=small, network=net)
    client = await connect(HOST, server.port, secret, "p-0", config=small, network=net)
    with pytest.raises(TransferTimeout, match="no flow-control credit"):
        await asyncio.wait_for(
            client.send_chunked(MsgType.KV_CHUNK, 1, bytes(4 * small.window_bytes)), 20
        )
    with pytest.raises(TransferTimeout, match="no frame"):
        await asyncio.wait_for(client.recv(timeout_s=0.3), 20)
    await client.close()
    await server.close()


async def test_peer_death_ends_transfers_with_link_down(net, secret, small) -> None:
    async def die(channel: Channel) -> None:
        await channel.recv()
        channel.abort()

    server = await serve(HOST, 0, secret, die, config=small, network=net)
    client = await connect(HOST, server.port, secret, "p-0", config=small, network=net)
    await client.send(MsgType.META, 1, b"{}")
    with pytest.raises(LinkDown):
        await asyncio.wait_for(client.recv(timeout_s=None), 20)
    with pytest.raises(LinkDown):
        await client.send(MsgType.KV_CHUNK, 1, b"x")
    await client.close()
    await server.close()


async def test_connect_failures_are_typed(net, secret, small) -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.Event().wait()  # holds the channel, never reads

    listener = await net.start_server(mute, HOST, 0)
    port = listener.port
    fast = TransportConfig(**{**small.__dict__, "connect_timeout_s": 0.3})
    with pytest.raises(TransferTimeout, match="handshake"):
        await connect(HOST, port, secret, "p-0", config=fast, network=net)
    listener.close()
    await listener.wait_closed()
    with pytest.raises(LinkDown, match="cannot connect"):
        await connect(HOST, port, secret, "p-0", config=fast, network=net)


async def test_counters_roll_up_into_a_per_link_total(net, echo_server, secret, small) -> None:
    wan = ByteCounters()
    channels = [
        await connect(
            HOST, echo_server.port, secret, f"p-{i}", config=small, counters=wan, network=net
        )
        for i in range(2)
    ]
    before = wan.payload_received  # the handshakes count too: they cross the link
    echoed = 0
    for channel in channels:
        await channel.send_chunked(MsgType.KV_CHUNK, 1, bytes(20_000))
        for _ in range(3):  # 20 kB in 8 KiB chunks
            echoed += len((await channel.recv()).payload)
    assert echoed == 2 * 20_000
    assert wan.payload_sent == sum(c.counters.payload_sent for c in channels)
    assert wan.payload_received == sum(c.counters.payload_received for c in channels)
    credits = wan.payload_received - before - echoed
    assert credits >= 0 and credits % 8 == 0  # the echo server's 8-byte CREDIT frames
    assert wan.wire_sent == wan.payload_sent + wan.frames_sent * HEADER_SIZE
    for channel in channels:
        await channel.close()


def test_config_rejects_a_window_smaller_than_a_frame() -> None:
    with pytest.raises(ValueError, match="must hold one full frame"):
        TransportConfig(max_frame_bytes=1024, chunk_bytes=1024, window_bytes=1024)
    with pytest.raises(ValueError, match="chunk_bytes"):
        TransportConfig(chunk_bytes=TransportConfig().max_frame_bytes + 1)
