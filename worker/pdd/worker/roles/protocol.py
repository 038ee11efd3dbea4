"""The data-plane conversation between instances, on top of the framed transport.

One conversation per request and purpose at a time on a channel, opened by the side
that has something to send; its first frame is a META ``{"op": ...}`` naming the
purpose. A channel whose conversation ended cleanly may carry the sender's next one
(P keeps its channels to MD and to each relay, MD its channels to each relay:
``transport.pool``); a
failed one is closed.

``prepare`` (P -> RLD over the fast path, P -> MD over the WAN)
    META ``{op, plan, codec, trace}`` -> receiver attaches the request (locking the prefix
    it already holds) and answers META ``{op: "prepared", hit, codec}``; P streams
    KV_CHUNK frames for ``[hit, n)`` and a KV_DONE ``{first_token,
    cached_tokens}`` (cached_tokens: P's own prefix hit, for the stream); the
    receiver answers META ``{op: "imported", n}`` once all of it is in its pool.
    Across the WAN P does not wait for ``prepared``: it starts from the plan's
    ``main_hit_tokens`` (the router's prediction), skips chunks ``prepared`` shows
    MD holds, and sends the gap ``[hit, predicted)`` MD lacks after the rest.
``kv_complete`` (MD -> RLD over the WAN)
    META ``{op, request_id, have}`` -> RLD answers TOKEN_IDS for the output
    positions ``[have, ...)`` it generated (flags: FINAL = last chunk, FINISHED
    = RLD already finished the request). After a non-final chunk MD asks
    META ``{op: "more", have}``; after the final one it sends ACK, and only
    then does RLD free the request's KV.

A conversation's opening META may carry ``trace``: the W3C context (``{"traceparent":
...}``) of the sender's span for it (P's ``pdd.kv_transfer``, MD's ``pdd.handoff``), so
the receiver's span joins the request's trace under it (``meta_trace``); empty or absent
where the sender does not trace.

Either side may answer ERROR ``{code, message}`` instead; the other side ends
the request with that outcome. P's ERROR whose code is a ``TokenEvent.error_type``
(``REQUEST_FAULTS``: the request's own work failed in P's engine, its grammar say) makes
the receiver end the request with P's message and that type, blaming no instance.
"""

from __future__ import annotations

from typing import Any

from pdd.common.grammar import GRAMMAR_ERROR_TYPE
from pdd.common.wire import REQUEST_FAILED_ERROR_TYPE
from pdd.worker.transport import (
    Channel,
    Frame,
    MsgType,
    TransportError,
    decode_error,
    decode_json,
    encode_error,
    encode_json,
    request_key,
)

FLAG_FINAL = 1
FLAG_FINISHED = 2

#: ERROR codes that say the request's own work failed, not the peer: the receiver passes
#: them on as its stream's ``TokenEvent.error_type``.
REQUEST_FAULTS = (GRAMMAR_ERROR_TYPE, REQUEST_FAILED_ERROR_TYPE)


class PeerError(TransportError):
    """The peer answered with an ERROR frame: its ``code`` and its own message
    (``detail``)."""

    def __init__(self, message: str, code: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail


class ProtocolError(TransportError):
    """The peer sent a frame this step of the conversation does not allow."""


async def send_meta(channel: Channel, rid: str, **fields: Any) -> None:
    """A META frame ``{request_id, **fields}`` tagged with the request's key."""
    await channel.send(MsgType.META, request_key(rid), encode_json({"request_id": rid, **fields}))


async def send_error(channel: Channel, request_id: str, code: str, message: str) -> None:
    if channel.is_open:
        await channel.send(MsgType.ERROR, request_key(request_id), encode_error(code, message))


async def expect(channel: Channel, *allowed: MsgType, timeout_s: float | None = None) -> Frame:
    """The next frame, which must be one of ``allowed``; an ERROR becomes ``PeerError``."""
    frame = await (channel.recv() if timeout_s is None else channel.recv(timeout_s))
    if frame.msg_type == MsgType.ERROR:
        info = decode_error(frame.payload)
        message = f"{channel.peer.name} failed ({info.code}): {info.message}"
        raise PeerError(message, info.code, info.message)
    if frame.msg_type not in allowed:
        names = "/".join(t.name for t in allowed)
        raise ProtocolError(f"expected {names} from {channel.peer.name}, got {frame.msg_type.name}")
    return frame


async def expect_meta(channel: Channel, op: str, timeout_s: float | None = None) -> dict[str, Any]:
    msg = decode_json((await expect(channel, MsgType.META, timeout_s=timeout_s)).payload)
    if msg.get("op") != op:
        raise ProtocolError(f"expected op {op!r} from {channel.peer.name}, got {msg.get('op')!r}")
    return msg


def meta_trace(msg: dict[str, Any]) -> dict[str, str] | None:
    """The META's ``trace`` carrier, None where it has none (or not one of strings)."""
    trace = msg.get("trace")
    if not isinstance(trace, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in trace.items()
    ):
        return None
    return trace


def int_field(msg: dict[str, Any], name: str) -> int:
    value = msg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"field {name!r} must be a non-negative integer, got {value!r}")
    return value


def split_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {addr!r} is not HOST:PORT")
    return host, int(port)
