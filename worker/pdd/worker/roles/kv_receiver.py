"""The receiving end of ``prepare``: attach a request, import its KV, learn its first token.

Shared by the relay (fast path, all of the prompt's KV it lacks) and the main
decode (WAN path, only its miss). The attach locks the prefix this instance
already holds, so it cannot be evicted while the rest is in flight; any failure
aborts the attached request, which releases the lock and the blocks.
"""

from __future__ import annotations

from pdd.common.wire import PipelinePlan
from pdd.worker.kv_transfer import KVTransferError
from pdd.worker.request import RequestError
from pdd.worker.roles.base import RoleBase, sampling_params
from pdd.worker.roles.protocol import ProtocolError, expect, send_error, send_meta
from pdd.worker.transport import Channel, MsgType, TransportError, decode_json


class KVReceiveError(Exception):
    """The KV never arrived complete; the message says why (for the stream's error event)."""


async def receive_kv(role: RoleBase, channel: Channel, plan: PipelinePlan, use_cache: bool) -> int:
    """Attach, import every chunk, return the first token; the request is attached on success.

    ``use_cache=False`` (the naive baseline) empties the prefix cache first, so
    the whole KV crosses the link.
    """
    rid, n = plan.request_id, len(plan.prompt_ids)
    params = sampling_params(plan)

    def attach(engine) -> int:
        if not use_cache:
            engine.reset_prefix_cache()
        return engine.attach_request(plan.prompt_ids, params, rid)

    try:
        hit = await role.runner.call(attach)
    except RequestError as exc:
        await send_error(channel, rid, "attach_failed", str(exc))
        raise KVReceiveError(f"cannot take the request: {exc}") from exc
    role.metrics.count_prompt(n, hit)
    try:
        await send_meta(channel, rid, op="prepared", hit=hit)
        first_token = await _import_all(role, channel, rid)
        await send_meta(channel, rid, op="imported", n=n)
    except (TransportError, KVTransferError, RequestError) as exc:
        await role.abort_engine_request(rid)
        if isinstance(exc, KVTransferError | RequestError):
            await send_error(channel, rid, "import_failed", str(exc))
        raise KVReceiveError(f"KV transfer from {channel.peer.name} failed: {exc}") from exc
    return first_token


async def _import_all(role: RoleBase, channel: Channel, rid: str) -> int:
    while True:
        frame = await expect(channel, MsgType.KV_CHUNK, MsgType.KV_DONE)
        if frame.msg_type == MsgType.KV_DONE:
            token = decode_json(frame.payload).get("first_token")
            if not isinstance(token, int) or isinstance(token, bool):
                raise ProtocolError(f"KV_DONE carries no first_token: {frame.payload[:100]!r}")
            return token
        payload = frame.payload
        await role.runner.call(lambda e, p=payload: e.import_kv(rid, p))
