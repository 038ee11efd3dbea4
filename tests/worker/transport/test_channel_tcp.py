"""The same channels over real loopback sockets: the TCP network under the transport.

Everything about framing, the handshake and flow control is checked on the
in-memory network (``test_channel``); this checks that the real sockets carry it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdd.worker.transport import AuthError, LinkDown, MsgType, connect, serve
from pdd.worker.transport.payloads import decode_token_ids, encode_token_ids

pytestmark = pytest.mark.integration


async def test_round_trip_rejection_and_refusal_over_tcp(secret, small, echo_handler) -> None:
    # The small window makes flow control engage; the timeouts are only a backstop.
    small = dataclasses.replace(small, read_timeout_s=120, write_timeout_s=120)
    server = await serve("127.0.0.1", 0, secret, echo_handler, name="md-0", config=small)
    try:
        channel = await connect("127.0.0.1", server.port, secret, "rld-0", config=small)
        assert channel.peer.name == "md-0"

        async def take_echoes() -> int:
            received = 0
            while received < 100_000:
                received += len((await channel.recv()).payload)
            return received

        reading = asyncio.create_task(take_echoes())  # the echoes come back as we send
        await channel.send_chunked(MsgType.KV_CHUNK, 7, bytes(100_000))  # several windows
        assert await reading == 100_000
        await channel.send(MsgType.TOKEN_IDS, 42, encode_token_ids(100, [5, 6, 7]))
        assert decode_token_ids((await channel.recv()).payload).ids == [5, 6, 7]
        await channel.close()
        with pytest.raises(AuthError):
            await connect("127.0.0.1", server.port, "wrong", "intruder", config=small)
        port = server.port
    finally:
        await server.close()
    with pytest.raises(LinkDown, match="cannot connect"):
        await connect("127.0.0.1", port, secret, "late", config=small)
