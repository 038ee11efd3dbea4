"""Main decode (MD): take the WAN KV after the prefix it holds, then the relay's token IDs.

Once its KV is complete MD continues the request: in P-MD (and naive) it
starts from the first token and streams from position 0; in P-RLD-MD it asks
the relay for the token IDs generated meanwhile, recomputes their KV in one
extend pass (``resume``/``extend``; catch-up chunks are computed with sampling
held), acknowledges the final chunk, and streams from the first position the
relay did not. If the relay is unreachable, the IDs the client already
received (POSTed by the stream layer to ``/handoff``) serve instead. Finished
sequences stay in MD's radix cache (the DRC), so the next turn hits; that includes
those the relay finished before the handoff, whose answers MD computes from the IDs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from pdd.common import tracing
from pdd.common.kv_codec import codec_of_handshake, shared_in_receiver_cache
from pdd.common.vocabulary import Pipeline, Role
from pdd.common.wire import Endpoint, PipelinePlan, TokenLogprobs
from pdd.worker.engine.request import RequestError
from pdd.worker.roles.base import NoSuchRequestError, RoleBase
from pdd.worker.roles.kv_receiver import (
    KVReceiveError,
    first_position_logprobs,
    import_attributes,
    receive_kv,
)
from pdd.worker.roles.landing import LandingKV
from pdd.worker.roles.protocol import (
    FLAG_FINAL,
    FLAG_FINISHED,
    KVComplete,
    More,
    Prepare,
    expect,
    send_error,
    send_meta,
)
from pdd.worker.roles.session import DecodeSession
from pdd.worker.transport import (
    Channel,
    MsgType,
    TransportError,
    decode_token_ids,
    request_key,
)
from pdd.worker.transport.pool import ChannelPool, SpareOpener

log = logging.getLogger(__name__)


@dataclass
class MainRequest:
    """MD's view of one request; created by whichever comes first (KV or a /handoff POST)."""

    posted: asyncio.Future[list[int]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    session: DecodeSession | None = None
    prefill_hit: int | None = None  # P's own hit: streamed on seq 0 if MD streams it
    md_hit: int | None = None  # MD's handshake hit (None for naive: it bypasses the cache)
    #: P's logprobs of the first token (position 0), streamed if MD streams that position.
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    #: Its KV goes into MD's prefix cache (``shared_in_receiver_cache``); False where it
    #: crossed coded under ``adaptive``: then neither it nor its answer is cached.
    shares_kv: bool = True


class MainDecodeRole(RoleBase):
    role = Role.MAIN

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: dict[str, MainRequest] = {}
        #: KV of earlier requests still on its way into the cache, which a later turn of
        #: the same conversation waits for (fixed block size: safe off the engine thread).
        self.landing = LandingKV(self.runner.engine.config.block_size)
        #: Warm channels to each relay across the WAN for the token-ID hand-off
        #: (``ChannelPool``): a fresh one pays TCP's, TLS's and the HMAC handshake's round
        #: trips first, while the relay holds the request and the conversation's next
        #: turn waits for its answer to land here (``landing``).
        self.relay_pool = ChannelPool()
        self.answer(Prepare, self._on_prepare)

    async def close(self) -> None:
        await super().close()
        await self.relay_pool.close()

    def _entry(self, rid: str) -> MainRequest:
        if rid not in self.requests:
            self.requests[rid] = MainRequest()
        return self.requests[rid]

    async def _on_prepare(self, channel: Channel, msg: Prepare) -> bool:
        """Receive a request's KV; True (P may send the next request on this channel)
        once all of it is in, False when the transfer failed."""
        plan = msg.plan
        rid = plan.request_id
        self.meter_wan(channel, Role.PREFILL, sends=False)  # P -> MD always crosses the WAN
        if rid in self.cancelled:  # its cancel overtook P's prepare
            await send_error(channel, rid, "cancelled", f"request {rid!r} was cancelled")
            return False
        self.live.add(rid)
        self.hub.get(rid).start()
        entry = self._entry(rid)
        use_cache = plan.pipeline != Pipeline.NAIVE
        answer_by = self.answer_deadline()
        codec = codec_of_handshake(msg.codec)
        entry.shares_kv = codec is not None and shared_in_receiver_cache(
            codec, self.settings.kv_codec
        )
        try:
            with tracing.span("pdd.kv_import", msg.trace, import_attributes(plan, msg)):
                if use_cache:
                    # Where MD prefills, it computes whatever has not landed: nothing would
                    # cross twice, so the request does not wait for an earlier one's KV.
                    await self._wait_for_landing_kv(
                        rid, plan.prompt_ids, entry.shares_kv, wait=not plan.md_prefills
                    )
                received = await receive_kv(
                    self, channel, plan, use_cache, msg.codec,
                    self.settings.kv_codec,
                    attach_wait_s=answer_by - asyncio.get_running_loop().time(),
                )  # fmt: skip
        except KVReceiveError as exc:
            self._end(rid, error=str(exc), culprit=exc.culprit, error_type=exc.error_type)
            return False
        if rid in self.cancelled:  # cancelled while its KV came in: nobody reads it
            await self.abort_engine_request(rid)
            self._end(rid, error="cancelled")
            return True
        entry.prefill_hit = received.prefill_hit
        entry.md_hit = received.hit if use_cache else None
        entry.logprobs = first_position_logprobs(received)
        self.spawn(self._continue(plan, entry, received.first_token), f"main-{rid}")
        return True

    async def _wait_for_landing_kv(
        self, rid: str, prompt_ids: list[int], lands: bool, wait: bool = True
    ) -> None:
        """Let KV already on its way (an earlier turn's) land before attaching, so it is
        not asked for again; bounded by half of P's wait for the answer to ``prepare``.
        ``lands``: this request's own KV will be cached (later turns may wait for it);
        not ``wait``: only say so."""
        if lands:
            self.landing.expect(rid, prompt_ids)
        if not wait:
            return

        async def cached() -> int:
            return await self.runner.call(lambda e: e.cached_prefix_tokens(prompt_ids))

        timeout_s = self.settings.transport.connect_timeout_s / 2
        await self.landing.wait_ahead(rid, prompt_ids, cached, timeout_s)

    async def _continue(
        self, plan: PipelinePlan, entry: MainRequest, first_token: int | None
    ) -> None:
        attributes = {tracing.REQUEST_ID: plan.request_id, "pdd.pipeline": str(plan.pipeline)}
        with tracing.span("pdd.main.decode", plan.trace_context, attributes) as span:
            await self._continue_traced(plan, entry, first_token)
            session = entry.session
            if session is not None:
                span.set_attributes(
                    {"pdd.streamed_tokens": session.emitted - session.emit_from,
                     "pdd.output_tokens": len(session.output),
                     "pdd.finish_reason": session.finish_reason or ""}
                )  # fmt: skip

    async def _continue_traced(
        self, plan: PipelinePlan, entry: MainRequest, first_token: int | None
    ) -> None:
        rid = plan.request_id
        try:
            if first_token is None:  # MD prefills: it samples the first token itself
                await self._start(rid, entry, [], emit_from=0, flush=False)
            elif plan.relay is None or plan.pipeline != Pipeline.P_RLD_MD:
                await self._start(rid, entry, [first_token], emit_from=0)
            elif entry.posted.done():
                await self._start_from_posted(rid, entry, first_token, handed=1, started=False)
            else:
                await self._handoff_from_relay(plan, entry, first_token)
            if entry.session is not None:
                await entry.session.done.wait()
        except Exception as exc:  # every failure ends the request here with a clear outcome
            if not isinstance(exc, RequestError | TransportError | TimeoutError):
                log.exception("main decode of %s failed", rid)
            await self.abort_engine_request(rid)
            self._end(rid, error=f"main decode gave up on the request: {exc!r}")
            return
        self._end(rid)

    def _new_session(
        self, rid: str, entry: MainRequest, ids: list[int], emit_from: int
    ) -> DecodeSession:
        """The session streaming positions ``emit_from..`` of ``ids`` and what follows."""
        entry.session = DecodeSession(
            rid,
            self.hub,
            output=list(ids),
            emit_from=emit_from,
            emitted=emit_from,
            cached_tokens=entry.prefill_hit,
            md_hit_tokens=entry.md_hit,
            logprobs=dict(entry.logprobs),
        )
        return entry.session

    async def _start(
        self, rid: str, entry: MainRequest, ids: list[int], emit_from: int, flush: bool = True
    ) -> None:
        """Resume after ``ids`` and stream from ``emit_from``: the handed tokens at once
        (P-MD's first token reaches the client now, not after the engine's current step
        and the resume's), or with the resume's first output where not ``flush``. Whether
        they end the request only the engine decides (stop ids, EOS, max_tokens, the
        grammar); if they do, the resume's output re-sends the last one marked finished,
        and the merger turns that into the stream's finish."""
        session = self._new_session(rid, entry, ids, emit_from)
        self.runner.subscribe(rid, session.on_output)
        if flush:
            session.flush()
        await self.runner.call(lambda e: e.resume(rid, ids))

    async def _handoff_from_relay(
        self, plan: PipelinePlan, entry: MainRequest, first_token: int
    ) -> None:
        """KV complete: take the relay's IDs (one-shot or catch-up chunks) and continue."""
        with tracing.span("pdd.extend", attributes={tracing.REQUEST_ID: plan.request_id}) as span:
            handed = await self._take_handoff(plan, entry, first_token)
            span.set_attributes({"pdd.extend.tokens": handed})

    async def _take_handoff(self, plan: PipelinePlan, entry: MainRequest, first_token: int) -> int:
        """The handoff itself; returns how many output positions MD took from the relay
        (the tokens its extend recomputes)."""
        rid = plan.request_id
        handed, started = 1, False  # positions MD holds: the first token, then the relay's
        try:
            relay = plan.relay
            assert relay is not None  # P-RLD-MD plans name a relay
            channel = await self.relay_pool.take_warm(relay.instance_id, self._relay_opener(relay))
            over = False  # the relay ended the conversation: the channel may carry another
            try:
                await send_meta(
                    channel, KVComplete(request_id=rid, have=handed, trace=tracing.carrier())
                )
                while True:
                    frame = await expect(channel, MsgType.TOKEN_IDS)
                    ids = decode_token_ids(frame.payload).ids
                    if frame.flags & FLAG_FINISHED:  # the relay finished it
                        over = True
                        rest = ids if started else [first_token, *ids]
                        await self._cache_finished(plan, entry, rest)
                        return handed + len(ids)
                    final = bool(frame.flags & FLAG_FINAL)
                    if not started:
                        await self._start_held(rid, entry, [first_token, *ids], hold=not final)
                        started = True
                    else:
                        entry.session.output.extend(ids)  # type: ignore[union-attr]
                        await self._extend(rid, ids, hold=not final)
                    handed += len(ids)
                    if final:
                        await channel.send(MsgType.ACK, request_key(rid))
                        over = True
                        entry.session.stream_from(handed)  # type: ignore[union-attr]
                        return handed
                    await self.runner.next_step()  # the chunk is computed; ask for the next
                    await send_meta(channel, More(request_id=rid, have=handed))
            finally:
                await self.relay_pool.release(relay.instance_id, channel, over)
        except TransportError as exc:
            log.warning("relay unreachable for %s (%s); waiting for the streamed ids", rid, exc)
            tracing.event("pdd.relay_unreachable", {"pdd.error": str(exc)})
            await self._start_from_posted(rid, entry, first_token, handed, started)
            return handed

    async def _extend(self, rid: str, ids: list[int], hold: bool) -> None:
        """Take the relay's next ``ids`` into the request and compute their KV; ``hold``:
        more chunks follow (this is not the final one)."""
        await self.runner.call(lambda e: e.extend(rid, ids, hold=hold))

    def _relay_opener(self, relay: Endpoint) -> SpareOpener:
        """Opens a channel to ``relay`` across the WAN (``ChannelPool.take_warm``)."""

        def opener(spare: bool) -> Awaitable[Channel]:
            return self.open_channel(relay, Role.RELAY, wan=True, sends=False, spare=spare)

        return opener

    async def _cache_finished(
        self, plan: PipelinePlan, entry: MainRequest, rest: list[int]
    ) -> None:
        """The relay streamed the whole answer: stream nothing, but compute the KV of the
        output it did not hand over (``rest``), so the DRC holds the whole conversation for
        the next turn as it does after a P-MD request; that turn waits for it (``landing``).
        If the engine cannot take the tokens, only the prompt's KV stays cached. KV that
        is not shared (``MainRequest.shares_kv``) is not worth computing: it is freed."""
        rid = plan.request_id
        if not entry.shares_kv:
            await self.abort_engine_request(rid)
            if entry.session is not None:
                entry.session.end_silently()
            return
        handed = entry.session.output if entry.session is not None else []
        self.landing.answered(rid, [*handed, *rest])
        computed = asyncio.Event()
        self.runner.subscribe(rid, lambda out: computed.set() if out.finished else None)
        try:
            await self.runner.call(lambda e: e.finished_elsewhere(rid, rest))
            await asyncio.wait_for(computed.wait(), self.settings.transfer_timeout_s)
        except (RequestError, TimeoutError) as exc:
            log.warning("cannot cache the answer of %s the relay finished: %r", rid, exc)
            await self.abort_engine_request(rid)
        if entry.session is not None:
            entry.session.end_silently()

    async def _start_held(self, rid: str, entry: MainRequest, ids: list[int], hold: bool) -> None:
        """Resume with the handed IDs, streaming nothing until the handoff is final."""
        session = self._new_session(rid, entry, ids, emit_from=len(ids))
        session.stop_at(len(ids))
        self.runner.subscribe(rid, session.on_output)
        await self.runner.call(lambda e: e.resume(rid, ids, hold=hold))

    async def _start_from_posted(
        self, rid: str, entry: MainRequest, first_token: int, handed: int, started: bool
    ) -> None:
        """The relay is gone: continue after the IDs the client already has."""
        posted = await asyncio.wait_for(entry.posted, self.settings.transfer_timeout_s)
        if not started:
            ids = posted or [first_token]
            await self._start(rid, entry, ids, emit_from=len(posted))
            return
        session = entry.session
        rest = posted[handed:]
        session.output.extend(rest)  # type: ignore[union-attr]
        await self.runner.call(lambda e: e.extend(rid, rest, hold=False))
        session.stream_from(len(posted))  # type: ignore[union-attr]

    def _end(
        self,
        rid: str,
        error: str | None = None,
        culprit: str | None = None,
        error_type: str | None = None,
    ) -> None:
        self.landing.landed(rid)
        entry = self.requests.pop(rid, None)
        if error is not None:
            seq = entry.session.emitted if entry and entry.session else 0
            self.hub.fail(rid, seq, error, culprit, error_type=error_type)
        else:
            self.hub.get(rid).close()
        self.runner.unsubscribe(rid)
        self.live.discard(rid)

    # --- control API --------------------------------------------------------------------------
    async def handoff(self, request_id: str, token_ids: list[int]) -> None:
        """The relay died: continue after these IDs (they may arrive before the KV does)."""
        known = request_id in self.requests
        entry = self._entry(request_id)
        if not entry.posted.done():
            entry.posted.set_result(list(token_ids))
        if not known:
            self.spawn(self._expire(request_id), f"expire-{request_id}")

    async def _expire(self, request_id: str) -> None:
        """Forget IDs posted for a request whose KV never came."""
        await asyncio.sleep(2 * self.settings.transfer_timeout_s)
        if request_id not in self.live:
            self.requests.pop(request_id, None)

    async def stop_request(self, request_id: str) -> None:
        if request_id not in self.requests:
            raise NoSuchRequestError(request_id)
        await self.abort_engine_request(request_id)
        self._end(request_id, error="cancelled")
