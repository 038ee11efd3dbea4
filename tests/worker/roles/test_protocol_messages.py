"""The P<->RLD<->MD conversation's messages (``pdd.worker.roles.protocol``): each op is a
model, sent in the bytes it always had, and a malformed one from a peer is refused with a
``ProtocolError`` naming the op and the field, before any of it is used.

The openings (``prepare``, ``kv_complete``) as a worker answers them are in
``tests/worker/dataplane/test_malformed_openings.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pdd.common.wire import Endpoint, PipelinePlan
from pdd.testing.memory_network import MemoryNetwork
from pdd.worker.roles.protocol import (
    Imported,
    KVComplete,
    KVDone,
    Meta,
    More,
    PeerError,
    Prepare,
    Prepared,
    ProtocolError,
    expect,
    expect_meta,
    read_kv_done,
    send_error,
    send_kv_done,
    send_meta,
)
from pdd.worker.transport import Channel, MsgType, connect, encode_json, request_key, serve

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

SECRET = "test-secret"
RID = "r-1"
MISSING = object()  # a field left out


def _endpoint(name: str) -> Endpoint:
    return Endpoint(
        instance_id=name, http_url=f"http://{name}:8000", fast_addr=f"{name}:9000",
        wan_addr=f"{name}-wan:9100",
    )  # fmt: skip


PLAN = PipelinePlan(
    request_id=RID, prompt_ids=[1, 2, 3], pipeline="P-MD", prefill=_endpoint("p"),
    main=_endpoint("md"),
).model_dump(mode="json")  # fmt: skip
TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}

#: One well-formed message per op, as the untyped ``send_meta(channel, rid, **fields)``
#: wrote it (``{"request_id": rid, "op": ..., **fields}``, in that order).
WELL_FORMED: list[tuple[type[Meta], dict[str, Any]]] = [
    (Prepare, {"request_id": RID, "op": "prepare", "plan": PLAN, "codec": "none", "trace": TRACE}),
    (Prepared, {"request_id": RID, "op": "prepared", "hit": 16, "codec": "int8.v2"}),
    (Imported, {"request_id": RID, "op": "imported", "n": 40}),
    (KVComplete, {"request_id": RID, "op": "kv_complete", "have": 1, "trace": {}}),
    (More, {"request_id": RID, "op": "more", "have": 9}),
]
BY_MODEL = dict(WELL_FORMED)

#: (model, field, bad value): each must be refused naming its op and that field.
MALFORMED: list[tuple[type[Meta], str, object]] = [
    (Prepare, "plan", {"request_id": 5}),
    (Prepare, "plan", MISSING),
    (Prepare, "codec", 8),
    (Prepare, "trace", {"traceparent": 7}),
    (Prepare, "request_id", 12),
    (Prepared, "hit", -1),
    (Prepared, "hit", True),
    (Prepared, "hit", "16"),
    (Prepared, "codec", ["none"]),
    (Imported, "n", "40"),
    (Imported, "n", MISSING),
    (Imported, "request_id", MISSING),
    (KVComplete, "have", None),
    (KVComplete, "have", -3),
    (KVComplete, "trace", "00-0af7"),
    (More, "have", 2.5),
    (More, "have", MISSING),
    (More, "surprise", 1),  # a field no version of the protocol has
]


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Channel, Channel]]:
    """(ours, theirs): the two ends of one authenticated channel on an in-memory network."""
    net = MemoryNetwork()
    theirs: asyncio.Future[Channel] = asyncio.get_running_loop().create_future()
    over = asyncio.Event()

    async def handler(channel: Channel) -> None:
        theirs.set_result(channel)
        await over.wait()

    server = await serve("peer", 0, SECRET, handler, name="peer", network=net)
    ours = await connect("peer", server.port, SECRET, "tester", network=net)
    yield ours, await theirs
    over.set()
    await ours.close()
    await server.close()


def _with(message: dict[str, Any], field: str, value: object) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k != field}
    if value is not MISSING:
        out[field] = value
    return out


@pytest.mark.parametrize(("model", "message"), WELL_FORMED, ids=lambda v: getattr(v, "op", ""))
async def test_each_op_travels_in_the_bytes_it_always_had(pair, model, message) -> None:
    ours, theirs = pair
    await send_meta(theirs, model.model_validate(message))
    frame = await ours.recv()
    assert frame.msg_type == MsgType.META and frame.request_id == request_key(RID)
    assert frame.payload == encode_json(message)  # the untyped protocol's exact bytes
    await send_meta(theirs, model.model_validate(message))
    assert await expect_meta(ours, model) == model.model_validate(message)


@pytest.mark.parametrize(("model", "field", "value"), MALFORMED)
async def test_a_malformed_field_is_refused_naming_the_op_and_the_field(
    pair, model, field, value
) -> None:
    ours, theirs = pair
    message = _with(BY_MODEL[model], field, value)
    await theirs.send(MsgType.META, request_key(RID), encode_json(message))
    op = message["op"]
    with pytest.raises(ProtocolError, match=rf"peer sent a malformed '{op}': field '{field}\b"):
        await expect_meta(ours, model)


async def test_another_op_than_the_step_expects_is_refused(pair) -> None:
    ours, theirs = pair
    await send_meta(theirs, Imported(request_id=RID, n=3))
    with pytest.raises(ProtocolError, match="expected op 'prepared' from peer, got 'imported'"):
        await expect_meta(ours, Prepared)


@pytest.mark.parametrize(
    "done",
    [
        {"first_token": 7, "cached_tokens": 16, "first_logprobs": None},
        {"first_token": None, "cached_tokens": None, "first_logprobs": None},  # MD prefills
        {
            "first_token": 7, "cached_tokens": 0,
            "first_logprobs": {"logprob": -0.5, "top": [{"token_id": 7, "logprob": -0.5}]},
        },
    ],
)  # fmt: skip
async def test_kv_done_travels_in_the_bytes_it_always_had(pair, done) -> None:
    ours, theirs = pair
    await send_kv_done(theirs, RID, KVDone.model_validate(done))
    frame = await expect(ours, MsgType.KV_DONE)
    assert frame.payload == encode_json(done) and frame.request_id == request_key(RID)
    assert read_kv_done(frame.payload, ours.peer.name) == KVDone.model_validate(done)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("first_token", "7"),
        ("first_token", -1),
        ("cached_tokens", False),
        ("cached_tokens", MISSING),
        ("first_logprobs", {"top": []}),
        ("first_logprobs", [0.5]),
    ],
)
async def test_a_malformed_kv_done_is_refused_naming_the_field(pair, field, value) -> None:
    ours, theirs = pair
    done = _with({"first_token": 7, "cached_tokens": 16, "first_logprobs": None}, field, value)
    await theirs.send(MsgType.KV_DONE, request_key(RID), encode_json(done))
    frame = await expect(ours, MsgType.KV_DONE)
    with pytest.raises(ProtocolError, match=rf"peer sent a malformed 'KV_DONE': field '{field}\b"):
        read_kv_done(frame.payload, ours.peer.name)


async def test_an_error_travels_as_it_always_did_and_a_malformed_one_is_refused(pair) -> None:
    ours, theirs = pair
    await send_error(theirs, RID, "attach_failed", "no room")
    frame = await ours.recv()
    assert frame.payload == encode_json({"code": "attach_failed", "message": "no room"})
    await theirs.send(MsgType.ERROR, request_key(RID), frame.payload)
    with pytest.raises(PeerError, match=r"peer failed \(attach_failed\): no room") as caught:
        await expect(ours, MsgType.META)
    assert (caught.value.code, caught.value.detail) == ("attach_failed", "no room")
    await theirs.send(MsgType.ERROR, request_key(RID), encode_json({"code": 5, "message": "?"}))
    with pytest.raises(ProtocolError, match=r"peer sent a malformed 'ERROR': field 'code'"):
        await expect(ours, MsgType.META)
