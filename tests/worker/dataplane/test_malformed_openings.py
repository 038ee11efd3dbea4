"""A conversation's opening META with a malformed field: the worker answers ``bad_request``
naming the op and the field (``roles.protocol``), holds nothing, and serves on.

In-process on a virtual clock; the process twin (a real ``pdd worker``) is
``test_security.test_malformed_messages_get_an_error``, the fuzzing one
``test_protocol_fuzz``.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdd.worker.roles.protocol import PeerError, expect, split_addr
from pdd.worker.transport import Channel, MsgType, connect, encode_json, request_key

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

#: Only a hang reaches it (virtual time): the answers come at once.
BACKSTOP_S = 60.0


async def _channel(vdp, name: str) -> Channel:
    host, port = split_addr(vdp.cluster[name].endpoint.fast_addr)
    network = vdp.cluster.network.host("tester")
    return await connect(host, port, vdp.cluster.secret, "tester", network=network)


async def _refusal(vdp, name: str, rid: str, message: dict[str, Any]) -> PeerError:
    """Open a conversation on ``name`` with ``message``; the ERROR it answers."""
    channel = await _channel(vdp, name)
    try:
        await channel.send(MsgType.META, request_key(rid), encode_json(message))
        with pytest.raises(PeerError) as caught:
            await expect(channel, MsgType.META, timeout_s=BACKSTOP_S)
    finally:
        await channel.close()
    return caught.value


def _prepare(vdp, rid: str, **fields: object) -> dict[str, Any]:
    plan = vdp.cluster.plan(rid, [1, 2, 3, 4, 5], "P-RLD-MD", vdp.sampling(0, 4))
    body = {"request_id": rid, "op": "prepare", "plan": plan.model_dump(mode="json")}
    return {**body, "codec": "none", "trace": {}, **fields}


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        ("md", "codec", 5),  # not a codec name at all (an unknown name is codec_mismatch)
        ("md", "trace", {"traceparent": 1}),
        ("rld", "trace", ["00-0af7"]),
        ("rld", "request_id", None),
        ("md", "plan", {"request_id": "bad-plan"}),
    ],
)
async def test_a_malformed_prepare_is_refused_naming_the_field(vdp, name, field, value) -> None:
    rid = f"bad-prepare-{name}-{field}"
    refusal = await _refusal(vdp, name, rid, _prepare(vdp, rid, **{field: value}))
    assert refusal.code == "bad_request"
    assert "malformed 'prepare'" in refusal.detail and f"field '{field}" in refusal.detail
    await vdp.assert_quiescent()  # nothing was attached, no stream was opened


@pytest.mark.parametrize(
    ("field", "value"), [("have", -1), ("have", "1"), ("have", True), ("request_id", 7)]
)
async def test_a_malformed_kv_complete_is_refused_naming_the_field(vdp, field, value) -> None:
    message = {"request_id": "bad-handoff", "op": "kv_complete", "have": 1, "trace": {}}
    refusal = await _refusal(vdp, "rld", "bad-handoff", {**message, field: value})
    assert refusal.code == "bad_request"
    assert "malformed 'kv_complete'" in refusal.detail and f"field '{field}'" in refusal.detail
    await vdp.assert_quiescent()


async def test_an_op_no_role_answers_is_still_unknown_op(vdp) -> None:
    message = {"request_id": "x", "op": "kv_complete", "have": 1}
    refusal = await _refusal(vdp, "md", "x", message)  # MD hands off; it takes no hand-off
    assert refusal.code == "unknown_op" and "does not handle op 'kv_complete'" in refusal.detail


async def test_the_worker_serves_a_request_after_malformed_openings(vdp) -> None:
    for name in ("md", "rld"):
        await _refusal(vdp, name, "bad", _prepare(vdp, "bad", codec=5))
    prompt = vdp.prompts(1, seed=91)[0]
    [reference] = await vdp.reference([prompt], 8, "after-bad")
    plan = vdp.cluster.plan("after-bad-0", prompt, "P-RLD-MD", vdp.sampling(0, 8))
    [run] = await vdp.run_all([plan])
    assert run.token_ids == reference
    await vdp.assert_quiescent()
