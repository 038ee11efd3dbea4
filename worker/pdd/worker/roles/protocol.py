"""The data-plane conversation between instances, on top of the framed transport.

One conversation per request and purpose at a time on a channel, opened by the side
that has something to send; its first frame is a META ``{"op": ...}`` naming the
purpose. A channel whose conversation ended cleanly may carry the sender's next one
(P keeps its channels to MD and to each relay, MD its channels to each relay:
``transport.pool``); a
failed one is closed.

``prepare`` (P -> RLD over the fast path, P -> MD over the WAN)
    META ``Prepare {op, plan, codec, trace}`` -> receiver attaches the request (locking
    the prefix it already holds) and answers META ``Prepared {op: "prepared", hit,
    codec}``; P streams KV_CHUNK frames for ``[hit, n)`` and a KV_DONE ``KVDone
    {first_token, cached_tokens, first_logprobs}`` (cached_tokens: P's own prefix hit,
    for the stream); the receiver answers META ``Imported {op: "imported", n}`` once all
    of it is in its pool.
    Across the WAN P does not wait for ``prepared``: it starts from the plan's
    ``main_hit_tokens`` (the router's prediction), skips chunks ``prepared`` shows
    MD holds, and sends the gap ``[hit, predicted)`` MD lacks after the rest.
``kv_complete`` (MD -> RLD over the WAN)
    META ``KVComplete {op, request_id, have, trace}`` -> RLD answers TOKEN_IDS for the
    output positions ``[have, ...)`` it generated (flags: FINAL = last chunk, FINISHED
    = RLD already finished the request). After a non-final chunk MD asks
    META ``More {op: "more", have}``; after the final one it sends ACK, and only
    then does RLD free the request's KV.

Every META carries the ``request_id`` too. A conversation's opening META may carry
``trace``: the W3C context (``{"traceparent": ...}``) of the sender's span for it (P's
``pdd.kv_transfer``, MD's ``pdd.handoff``), so the receiver's span joins the request's
trace under it; empty where the sender does not trace.

Either side may answer ERROR ``{code, message}`` (``transport.ErrorInfo``) instead; the
other side ends the request with that outcome. P's ERROR whose code is a
``TokenEvent.error_type`` (``REQUEST_FAULTS``: the request's own work failed in P's
engine, its grammar say) makes the receiver end the request with P's message and that
type, blaming no instance.

Each message is a model here, sent (``send_meta``, ``send_kv_done``) and read
(``expect_meta``, ``read_kv_done``, ``RoleBase.answer``) in this one place: what a peer
sends is validated before any of it is used, and a malformed message is a
``ProtocolError`` naming the op and the field. One deployment runs one build, so the
models forbid fields they do not know; the bytes are those the protocol always had.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from pdd.common.grammar import GRAMMAR_ERROR_TYPE
from pdd.common.kv_codec import NO_CODEC
from pdd.common.wire import REQUEST_FAILED_ERROR_TYPE, PipelinePlan, TokenLogprobs
from pdd.worker.transport import (
    Channel,
    Frame,
    FrameError,
    MsgType,
    TransportError,
    decode_error,
    decode_json,
    encode_error,
    encode_json,
    request_key,
)
from pdd.worker.transport.payloads import validated

FLAG_FINAL = 1
FLAG_FINISHED = 2

#: ERROR codes that say the request's own work failed, not the peer: the receiver passes
#: them on as its stream's ``TokenEvent.error_type``.
REQUEST_FAULTS = (GRAMMAR_ERROR_TYPE, REQUEST_FAILED_ERROR_TYPE)

#: A count of tokens or positions: a JSON integer, never a bool, a float or a string of
#: digits (pydantic's lax mode would take those), never negative.
Count = Annotated[int, Field(strict=True, ge=0)]
#: A W3C trace carrier (``tracing.carrier``); None where the sender sent none.
TraceCarrier = dict[str, str] | None


class PeerError(TransportError):
    """The peer answered with an ERROR frame: its ``code`` and its own message
    (``detail``)."""

    def __init__(self, message: str, code: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail


class ProtocolError(TransportError):
    """The peer sent a frame this step of the conversation does not allow, or a message
    with a field that is missing, unknown or of the wrong kind."""


class Message(BaseModel):
    """A JSON message of the conversation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def kind(cls) -> str:
        """What errors call it: its op for a META, else its frame type."""
        raise NotImplementedError


class Meta(Message):
    """A META frame: ``{request_id, op, ...}``, tagged with the request's key."""

    request_id: str

    @classmethod
    def kind(cls) -> str:
        return str(cls.model_fields["op"].default)


class Prepare(Meta):
    """P -> receiver, opening: the request, the KV codec P sends in, P's span."""

    op: Literal["prepare"] = "prepare"
    plan: PipelinePlan
    codec: str = NO_CODEC  # ``kv_codec.handshake_name``; the receiver checks it is one
    trace: TraceCarrier = None


class Prepared(Meta):
    """Receiver -> P: the prefix it holds (and locked), the codec it takes."""

    op: Literal["prepared"] = "prepared"
    hit: Count
    codec: str = NO_CODEC


class Imported(Meta):
    """Receiver -> P: all ``n`` prompt tokens' KV is in its pool."""

    op: Literal["imported"] = "imported"
    n: Count


class KVComplete(Meta):
    """MD -> RLD, opening: MD's KV is complete; it holds output positions ``[0, have)``."""

    op: Literal["kv_complete"] = "kv_complete"
    have: Count
    trace: TraceCarrier = None


class More(Meta):
    """MD -> RLD: the next chunk of IDs, from ``have`` on."""

    op: Literal["more"] = "more"
    have: Count


class KVDone(Message):
    """P -> receiver, the KV_DONE frame: P's first token (output position 0), its prefix
    hit and the token's logprobs; all None where MD prefills (P computed nothing)."""

    first_token: Count | None
    cached_tokens: Count | None
    first_logprobs: TokenLogprobs | None = None

    @classmethod
    def kind(cls) -> str:
        return "KV_DONE"


M = TypeVar("M", bound=Message)
Opening = TypeVar("Opening", Prepare, KVComplete)
#: Runs one conversation from its opening META (decoded JSON, read by ``answering``);
#: True when the channel may carry another (the sender keeps its WAN channels warm:
#: ``transport.pool``), else the channel is closed after it.
OpHandler = Callable[[Channel, Mapping[str, object]], Awaitable[bool]]


async def send_meta(channel: Channel, msg: Meta) -> None:
    """``msg`` as a META frame tagged with its request's key."""
    await channel.send(MsgType.META, request_key(msg.request_id), _encode(msg))


async def send_kv_done(channel: Channel, request_id: str, done: KVDone) -> None:
    await channel.send(MsgType.KV_DONE, request_key(request_id), _encode(done))


async def send_error(channel: Channel, request_id: str, code: str, message: str) -> None:
    if channel.is_open:
        await channel.send(MsgType.ERROR, request_key(request_id), encode_error(code, message))


async def expect(channel: Channel, *allowed: MsgType, timeout_s: float | None = None) -> Frame:
    """The next frame, which must be one of ``allowed``; an ERROR becomes ``PeerError``."""
    frame = await (channel.recv() if timeout_s is None else channel.recv(timeout_s))
    if frame.msg_type == MsgType.ERROR:
        try:
            info = decode_error(frame.payload)
        except FrameError as exc:
            raise ProtocolError(f"{channel.peer.name} sent a malformed 'ERROR': {exc}") from None
        message = f"{channel.peer.name} failed ({info.code}): {info.message}"
        raise PeerError(message, info.code, info.message)
    if frame.msg_type not in allowed:
        names = "/".join(t.name for t in allowed)
        raise ProtocolError(f"expected {names} from {channel.peer.name}, got {frame.msg_type.name}")
    return frame


async def expect_meta(channel: Channel, model: type[M], timeout_s: float | None = None) -> M:
    """The next frame, which must be a META of ``model``'s op, read into it."""
    frame = await expect(channel, MsgType.META, timeout_s=timeout_s)
    return read(model, decode_json(frame.payload), channel.peer.name)


def read_kv_done(payload: bytes, peer: str) -> KVDone:
    """A KV_DONE frame's payload, from ``peer``."""
    return read(KVDone, decode_json(payload), peer)


def read(model: type[M], msg: Mapping[str, object], peer: str) -> M:
    """``msg`` (a decoded payload from ``peer``) as ``model``; ``ProtocolError`` where it
    is another op or a field does not fit."""
    if issubclass(model, Meta) and msg.get("op") != model.kind():
        raise ProtocolError(f"expected op {model.kind()!r} from {peer}, got {msg.get('op')!r}")
    try:
        return validated(model, msg)
    except FrameError as exc:
        raise ProtocolError(f"{peer} sent a malformed {model.kind()!r}: {exc}") from None


def answering(
    model: type[Opening], handler: Callable[[Channel, Opening], Awaitable[bool]]
) -> OpHandler:
    """``handler`` for the conversations ``model`` opens, reading the opening into it."""

    async def run(channel: Channel, first: Mapping[str, object]) -> bool:
        return await handler(channel, read(model, first, channel.peer.name))

    return run


def _encode(msg: Message) -> bytes:
    return encode_json(msg.model_dump(mode="json"))


def split_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {addr!r} is not HOST:PORT")
    return host, int(port)
