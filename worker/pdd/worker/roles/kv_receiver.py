"""The receiving end of ``prepare``: attach a request, import its KV, learn its first token.

Shared by the relay (fast path, all of the prompt's KV it lacks) and the main
decode (WAN path, only its miss). The attach locks the prefix this instance
already holds, so it cannot be evicted while the rest is in flight; any failure
aborts the attached request, which releases the lock and the blocks. The
``prepare`` names the KV codec P will send (across the WAN it may compress); one
this instance was not configured for is refused before anything is attached.

An attach the KV pool has no room for now (its free blocks, the prefix cache it may
evict and the running requests it may preempt are all short: the blocks are held by
other requests whose KV is still coming) waits, as a request waits in vLLM's waiting
queue, until a step or a release frees enough, instead of being refused at once. The
wait is bounded by the sender's patience for the answer (``attach_wait_s``): past it
the request is refused and the router routes it elsewhere or answers 429.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any

from pdd.common import tracing
from pdd.common.kv_codec import (
    NO_CODEC,
    KVCodec,
    KVCodecSetting,
    codec_of_handshake,
    handshake_name,
    shared_in_receiver_cache,
    takes_codec,
)
from pdd.common.wire import PipelinePlan, TokenLogprobs
from pdd.worker.engine import Engine
from pdd.worker.engine.isolation import fault_of
from pdd.worker.engine.kv_transfer import KVGapError, KVTransferError
from pdd.worker.engine.request import NoFreeBlocksError, RequestError
from pdd.worker.roles.base import RoleBase, sampling_params
from pdd.worker.roles.protocol import (
    REQUEST_FAULTS,
    Imported,
    KVDone,
    PeerError,
    Prepare,
    Prepared,
    ProtocolError,
    expect,
    read_kv_done,
    send_error,
    send_meta,
)
from pdd.worker.transport import Channel, MsgType, TransportError


class KVReceiveError(Exception):
    """The KV never arrived complete; the message says why (for the stream's error event),
    ``culprit`` which instance failed where it was the sender (its link or its data),
    ``error_type`` where the request's own work failed in P's engine instead (its
    grammar, say: ``TokenEvent.error_type``)."""

    def __init__(
        self, message: str, culprit: str | None = None, error_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.culprit = culprit
        self.error_type = error_type


@dataclass(frozen=True)
class ReceivedKV:
    #: Sampled by P: output position 0; None where MD prefills (``PipelinePlan.md_prefills``)
    #: and samples it itself.
    first_token: int | None
    prefill_hit: int  # prompt tokens P took from its own prefix cache (MD's hit: MD prefills)
    hit: int  # prompt tokens this instance already held (not transferred)
    first_logprobs: TokenLogprobs | None = None  # P's, where the request asked for logprobs


def first_position_logprobs(received: ReceivedKV) -> dict[int, TokenLogprobs]:
    """A decode session's logprobs to start with: P's, for output position 0."""
    return {} if received.first_logprobs is None else {0: received.first_logprobs}


def import_attributes(plan: PipelinePlan, msg: Prepare) -> dict[str, str | int]:
    """``pdd.kv_import``'s attributes: the request, its prompt, the codec P offered."""
    return {
        tracing.REQUEST_ID: plan.request_id,
        "pdd.prompt_tokens": len(plan.prompt_ids),
        "pdd.kv.codec": msg.codec,
    }


async def receive_kv(
    role: RoleBase, channel: Channel, plan: PipelinePlan, use_cache: bool,
    offered: str = NO_CODEC, expected: KVCodecSetting = NO_CODEC, attach_wait_s: float = 0.0,
) -> ReceivedKV:  # fmt: skip
    """Attach and import every chunk; the request is attached (awaiting resume) on success.

    ``offered`` is the codec the ``prepare`` named, ``expected`` what this path takes
    (the deployment's WAN codec on MD, none on the fast path; under ``adaptive``, any
    codec the router may choose: the handshake says which this transfer uses).

    ``use_cache=False`` (the naive baseline) attaches without the prefix cache
    (no match, nothing cached at the end), so the whole KV crosses the link and
    what the cache holds for other requests is left alone. KV coded where the cache
    must stay exact (``shared_in_receiver_cache``) hits the cache but is not added to it.

    ``attach_wait_s``: how long the attach may wait for blocks (see the module's note).
    """
    rid, n = plan.request_id, len(plan.prompt_ids)
    params = sampling_params(plan)
    codec = codec_of_handshake(offered)
    if codec is None or not takes_codec(expected, codec):
        takes = expected if expected == "adaptive" else handshake_name(expected)
        message = (
            f"{channel.peer.name} sends KV coded {offered!r}, this {role.role} instance takes "
            f"{takes!r} on this path; give P and MD the same "
            "spec.wan.kvCodec (--kv-codec) and the same build"
        )
        await send_error(channel, rid, "codec_mismatch", message)
        raise KVReceiveError(f"cannot take the request: {message}")

    private = not shared_in_receiver_cache(codec, expected)
    try:
        hit = await _attach_when_room(role, plan, params, use_cache, private, attach_wait_s)
    except RequestError as exc:
        await send_error(channel, rid, "attach_failed", str(exc))
        raise KVReceiveError(f"cannot take the request: {exc}", error_type=fault_of(exc)) from exc
    role.metrics.count_prompt(n, hit)
    tracing.set_attributes({"pdd.hit_tokens": hit, "pdd.kv.tokens": n - hit})
    try:
        await send_meta(channel, Prepared(request_id=rid, hit=hit, codec=handshake_name(codec)))
        done = await _import_all(role, channel, rid, codec)
        if plan.md_prefills:  # P computed nothing: this instance prefills and samples
            first_token, prefill_hit, first_logprobs = None, hit, None
        else:
            first_token, prefill_hit = _sampled(done, channel.peer.name)
            first_logprobs = done.first_logprobs
        await send_meta(channel, Imported(request_id=rid, n=n))
    except (TransportError, KVTransferError, RequestError) as exc:
        await role.abort_engine_request(rid)
        if isinstance(exc, KVTransferError | RequestError):
            await send_error(channel, rid, "import_failed", str(exc))
        if isinstance(exc, PeerError) and exc.code in REQUEST_FAULTS:  # not P's fault
            raise KVReceiveError(exc.detail, error_type=exc.code) from exc
        culprit = None if isinstance(exc, RequestError) else channel.peer.name
        raise KVReceiveError(
            f"KV transfer from {channel.peer.name} failed: {exc}", culprit
        ) from exc
    return ReceivedKV(first_token, prefill_hit, hit, first_logprobs)


async def _attach_when_room(
    role: RoleBase, plan: PipelinePlan, params: Any, use_cache: bool, private: bool,
    wait_s: float,
) -> int:  # fmt: skip
    """Attach ``plan``'s request as soon as the pool has room for it, trying again after
    each turn of the engine's loop (a step that finished requests, a release) until
    ``wait_s`` has passed; then ``NoFreeBlocksError``. A request cancelled while it
    waits stops waiting (``NoFreeBlocksError`` too: nothing was attached)."""
    rid, loop = plan.request_id, asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    waited = False
    while True:
        try:
            hit = await role.runner.call(
                lambda e: e.attach_request(
                    plan.prompt_ids,
                    params,
                    rid,
                    use_cache=use_cache,
                    private_kv=private,
                    samples_first=plan.md_prefills,
                )
            )
        except NoFreeBlocksError:
            left = deadline - loop.time()
            if left <= 0 or rid in role.cancelled:
                raise
            if not waited:
                waited = True
                role.metrics.kv_waits.inc()
            with contextlib.suppress(TimeoutError):  # then one last try at the deadline
                await asyncio.wait_for(role.runner.next_step(), left)
            continue
        return hit


async def _import_all(role: RoleBase, channel: Channel, rid: str, codec: KVCodec) -> KVDone:
    """Import chunks until KV_DONE; returns its message (first token, P's prefix hit, the
    first token's logprobs).

    P may start from the router's predicted hit, above what this instance holds: the
    chunks past a gap wait here (the request's own KV, so bounded by its miss) until
    the gap's chunks, which P sends once it has this instance's answer, fill it. Chunks
    below what it holds are skipped by the import (never overwritten)."""
    ahead: list[bytes] = []
    while True:
        frame = await expect(channel, MsgType.KV_CHUNK, MsgType.KV_DONE)
        if frame.msg_type == MsgType.KV_DONE:
            if ahead:  # the gap never came: the import says which range is missing
                await _import_past_gap(role, rid, ahead[0], codec)
            return read_kv_done(frame.payload, channel.peer.name)
        ahead.append(frame.payload)
        ahead = await role.runner.call(
            partial(_import_in_order, rid=rid, chunks=ahead, codec=codec)
        )


async def _import_past_gap(role: RoleBase, rid: str, chunk: bytes, codec: KVCodec) -> None:
    """Import ``chunk``, which lies past a gap: its ``KVGapError`` names the missing range."""
    await role.runner.call(lambda e: e.import_kv(rid, chunk, codec))


def _import_in_order(engine: Engine, rid: str, chunks: list[bytes], codec: KVCodec) -> list[bytes]:
    """Import every chunk that continues what the request holds (on the engine thread);
    returns those still past a gap. Any other import error propagates."""
    waiting = list(chunks)
    progressed = True
    while waiting and progressed:
        progressed = False
        for chunk in list(waiting):
            try:
                engine.import_kv(rid, chunk, codec)
            except KVGapError:
                continue
            waiting.remove(chunk)
            progressed = True
    return waiting


def _sampled(done: KVDone, peer: str) -> tuple[int, int]:
    """The first token and P's prefix hit, which a KV_DONE must carry where P prefilled."""
    if done.first_token is None or done.cached_tokens is None:
        missing = "first_token" if done.first_token is None else "cached_tokens"
        raise ProtocolError(f"{peer} sent a KV_DONE without {missing!r}, but P prefilled")
    return done.first_token, done.cached_tokens
