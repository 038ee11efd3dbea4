"""Unauthenticated or malformed input is rejected, and the worker keeps serving."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdd.worker.roles.protocol import PeerError, expect, split_addr
from pdd.worker.transport import (
    AuthError,
    LinkDown,
    MsgType,
    TransportError,
    connect,
    encode_json,
    request_key,
)

pytestmark = pytest.mark.integration

#: Only a hang reaches it: the answers these tests wait for come at once.
BACKSTOP_S = 60.0


def _data_addr(dp, name: str) -> tuple[str, int]:
    return split_addr(dp.cluster[name].endpoint.fast_addr)


def _healthy(dp, name: str) -> bool:
    return httpx.get(f"{dp.cluster[name].url}/health").status_code == 200


async def test_wrong_secret_is_refused(dp) -> None:
    host, port = _data_addr(dp, "rld")
    with pytest.raises(AuthError):
        await connect(host, port, "not-the-secret", "intruder")
    assert _healthy(dp, "rld")


async def test_garbage_bytes_do_not_hurt_the_worker(dp) -> None:
    host, port = _data_addr(dp, "md")
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 8)
    await writer.drain()
    await asyncio.wait_for(reader.read(), BACKSTOP_S)  # the worker closes it
    writer.close()
    assert _healthy(dp, "md")


@pytest.mark.parametrize(
    ("msg_type", "payload", "code"),
    [
        (MsgType.KV_CHUNK, b"\x00" * 64, "bad_request"),  # must open with META
        (MsgType.META, encode_json({"op": "launch_missiles"}), "unknown_op"),
        (MsgType.META, encode_json({"op": "prepare", "plan": {"request_id": 5}}), "bad_request"),
    ],
)
async def test_malformed_messages_get_an_error(dp, msg_type, payload: bytes, code: str) -> None:
    host, port = _data_addr(dp, "md")
    channel = await connect(host, port, dp.cluster.secret, "tester")
    try:
        await channel.send(msg_type, request_key("x"), payload)
        with pytest.raises(PeerError, match=code):
            await expect(channel, MsgType.META, timeout_s=BACKSTOP_S)
    finally:
        await channel.close()
    assert _healthy(dp, "md")


async def test_a_corrupt_kv_chunk_aborts_only_that_request(dp) -> None:
    """A peer that sends bytes that are not KV: the request is refused, nothing leaks."""
    plan = dp.cluster.plan("bad-kv", [1, 2, 3, 4, 5], "P-MD", dp.sampling(0, 4))
    host, port = _data_addr(dp, "md")
    channel = await connect(host, port, dp.cluster.secret, "tester")
    try:
        key = request_key(plan.request_id)
        body = {
            "op": "prepare",
            "request_id": plan.request_id,
            "plan": plan.model_dump(mode="json"),
        }
        await channel.send(MsgType.META, key, encode_json(body))
        await expect(channel, MsgType.META, timeout_s=BACKSTOP_S)  # prepared
        await channel.send(MsgType.KV_CHUNK, key, b"PDDKV\x01 definitely not a chunk")
        with pytest.raises((PeerError, LinkDown, TransportError)):
            await expect(channel, MsgType.META, timeout_s=BACKSTOP_S)
    finally:
        await channel.close()
    await dp.assert_quiescent()


def test_control_api_requires_the_secret_and_the_right_role(dp) -> None:
    rld = dp.cluster["rld"]
    plan = dp.cluster.plan("wrong-role", [1, 2, 3], "P-RLD-MD")
    url = f"{rld.url}/v1/pdd/requests"
    assert httpx.post(url, content=plan.model_dump_json()).status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert httpx.post(url, content=plan.model_dump_json(), headers=bad).status_code == 401
    good = {"Authorization": f"Bearer {dp.cluster.secret}"}
    resp = httpx.post(url, content=plan.model_dump_json(), headers=good)
    assert resp.status_code == 409 and resp.json()["error"]["type"] == "wrong_role"
    p_url = f"{dp.cluster['p'].url}/v1/pdd/requests"
    resp = httpx.post(p_url, content=b'{"request_id": 1}', headers=good)
    assert resp.status_code == 400
    assert httpx.get(f"{rld.url}/load").json()["role"] == "relay"
    peers = f"{dp.cluster['p'].url}/v1/pdd/wan-peers"
    body = '{"main_decodes": []}'
    assert httpx.put(peers, content=body).status_code == 401
    assert httpx.put(peers, content=body, headers=good).status_code == 204
    resp = httpx.put(peers, content='{"main_decodes": [1]}', headers=good)
    assert resp.status_code == 400 and "error" in resp.json()
