"""Relay decode (RLD): decode at once from fast-path KV, then hand token IDs to MD.

RLD streams eager tokens while MD's copy of the KV crosses the WAN. When MD
says its KV is complete, RLD answers with the token IDs it generated (never
their KV): all at once (one-shot: RLD is freed soonest) or in chunks while it
keeps relaying (catch-up: MD's batch never stalls on one long extend), chosen
per request by the plan, the worker's flag, or RLD's load. RLD stops
streaming at the handoff point and frees the request when MD acknowledges; if
the acknowledgement never comes, it streams on and finishes the request itself.
Without a main decode (P-RLD) or after a takeover, it simply runs to completion.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdd.common import tracing
from pdd.common.handoff import choose_handoff_mode
from pdd.common.vocabulary import Role
from pdd.common.wire import PipelinePlan
from pdd.worker.roles.base import NoSuchRequestError, RoleBase
from pdd.worker.roles.kv_receiver import (
    KVReceiveError,
    first_position_logprobs,
    import_attributes,
    receive_kv,
)
from pdd.worker.roles.protocol import (
    FLAG_FINAL,
    FLAG_FINISHED,
    KVComplete,
    More,
    Prepare,
    expect,
    expect_meta,
    send_error,
)
from pdd.worker.roles.session import DecodeSession
from pdd.worker.transport import (
    Channel,
    MsgType,
    TransportError,
    encode_token_ids,
    request_key,
)

log = logging.getLogger(__name__)


class RelayRole(RoleBase):
    role = Role.RELAY

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sessions: dict[str, tuple[PipelinePlan, DecodeSession]] = {}
        #: Each live request's ``pdd.relay.decode`` span: a takeover is an event on it.
        self._decode_spans: dict[str, tracing.Span] = {}
        self._arrived = asyncio.Event()
        self.answer(Prepare, self._on_prepare)
        self.answer(KVComplete, self._on_kv_complete)

    # --- P -> RLD: KV over the fast path, then decode ------------------------------------------
    async def _on_prepare(self, channel: Channel, msg: Prepare) -> bool:
        """Receive a request's KV and start decoding it; True (P may send the next
        request on this channel) once all of it is in, False when the transfer failed."""
        plan = msg.plan
        rid = plan.request_id
        if rid in self.cancelled:  # its cancel overtook P's prepare
            await send_error(channel, rid, "cancelled", f"request {rid!r} was cancelled")
            return False
        self.live.add(rid)
        self.hub.get(rid).start()
        try:
            with tracing.span("pdd.kv_import", msg.trace, import_attributes(plan, msg)):
                received = await receive_kv(
                    self, channel, plan, use_cache=True, offered=msg.codec,
                    attach_wait_s=self.answer_deadline() - asyncio.get_running_loop().time(),
                )  # fmt: skip
        except KVReceiveError as exc:
            self.hub.fail(rid, 0, str(exc), error_type=exc.error_type)
            self.live.discard(rid)
            return False
        if rid in self.cancelled:  # cancelled while its KV came in: nobody reads it
            await self.abort_engine_request(rid)
            self.hub.get(rid).close()
            self.live.discard(rid)
            return True
        first_token = received.first_token
        assert first_token is not None  # P prefills wherever a relay serves
        session = DecodeSession(
            rid, self.hub, output=[first_token], cached_tokens=received.prefill_hit,
            logprobs=first_position_logprobs(received),
        )  # fmt: skip
        self.sessions[rid] = (plan, session)
        self._signal_arrival()
        decode = tracing.start_span(
            "pdd.relay.decode", plan.trace_context, {tracing.REQUEST_ID: rid}
        )
        self._decode_spans[rid] = decode
        self.runner.subscribe(rid, session.on_output)
        await self.runner.call(lambda e: e.resume(rid, [first_token]))
        self.spawn(self._forget_when_done(rid, session, decode), f"relay-{rid}")
        return True

    async def _forget_when_done(
        self, rid: str, session: DecodeSession, decode: tracing.Span
    ) -> None:
        await session.done.wait()
        decode.set_attributes(
            {"pdd.streamed_tokens": session.emitted, "pdd.decoded_tokens": len(session.output)}
        )
        decode.end()
        self._decode_spans.pop(rid, None)
        self.live.discard(rid)
        # Keep the record a while: MD may still ask, and must learn it finished here.
        await asyncio.sleep(self.settings.transfer_timeout_s)
        self.sessions.pop(rid, None)

    def _signal_arrival(self) -> None:
        self._arrived.set()
        self._arrived = asyncio.Event()

    async def _session(self, rid: str) -> tuple[PipelinePlan, DecodeSession]:
        """The request's session, waiting (bounded) if its KV has not arrived yet."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.transfer_timeout_s
        while rid not in self.sessions:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise NoSuchRequestError(rid)
            arrived = self._arrived
            await asyncio.wait_for(arrived.wait(), remaining)
        return self.sessions[rid]

    # --- MD -> RLD: the token-ID handoff ------------------------------------------------------
    async def _on_kv_complete(self, channel: Channel, msg: KVComplete) -> bool:
        """Hand ``request_id``'s IDs to MD; True (MD may open its next hand-off on this
        channel: it keeps them warm) once the hand-off is over, False when it failed."""
        rid = msg.request_id
        self.meter_wan(channel, Role.MAIN, sends=True)  # MD -> RLD always crosses the WAN
        try:
            plan, session = await self._session(rid)
        except (NoSuchRequestError, TimeoutError):
            await send_error(channel, rid, "unknown_request", f"relay has no request {rid!r}")
            return False
        mode = self._mode(plan)
        have = msg.have
        attributes: tracing.Attributes = {
            tracing.REQUEST_ID: rid, "pdd.handoff.mode": mode, "pdd.handoff.from": have,
        }  # fmt: skip
        try:
            with tracing.span("pdd.handoff", msg.trace, attributes) as span:
                if self.draining:  # why the plan's catch-up became one shot
                    tracing.event("pdd.drain", {"pdd.instance": self.settings.instance_id})
                rounds = 1
                while not await self._hand(channel, plan, session, have, mode):
                    have = (await expect_meta(channel, More)).have
                    rounds += 1
                handed = len(session.output) - msg.have
                span.set_attributes({"pdd.handoff.rounds": rounds, "pdd.handoff.tokens": handed})
                return True
        except TransportError as exc:
            log.warning("handoff of %s to %s failed: %s", rid, channel.peer.name, exc)
            self.metrics.transfer_failures.labels("handoff").inc()
            session.unlimit()
            return False

    async def _hand(
        self, channel: Channel, plan: PipelinePlan, session: DecodeSession, have: int, mode: str
    ) -> bool:
        """Send the IDs past ``have``; True once the handoff is over (final or finished)."""
        ids = session.output[have:]
        if session.finished:
            await self._send_ids(channel, plan.request_id, have, ids, FLAG_FINISHED)
            return True
        final = mode == "one-shot" or len(ids) <= plan.catchup_threshold
        if not final:
            await self._send_ids(channel, plan.request_id, have, ids, 0)
            return False
        session.stop_at(len(session.output))
        await self._send_ids(channel, plan.request_id, have, ids, FLAG_FINAL)
        await expect(channel, MsgType.ACK)
        self.metrics.handoffs.labels(mode).inc()
        session.end_silently()
        await self.abort_engine_request(plan.request_id)
        self.runner.unsubscribe(plan.request_id)
        return True

    async def _send_ids(
        self, channel: Channel, rid: str, start: int, ids: list[int], flags: int
    ) -> None:
        payload = encode_token_ids(start, ids)
        await channel.send(MsgType.TOKEN_IDS, request_key(rid), payload, flags)
        self.metrics.handoff_tokens.inc(len(ids))
        self.metrics.handoff_bytes.inc(len(payload))

    def _mode(self, plan: PipelinePlan) -> str:
        if self.draining:  # hand everything over at once: the relay is on its way out
            return "one-shot"
        s = self.settings
        return choose_handoff_mode(plan.handoff, s.handoff, self.relay_load(), s.catchup_load_level)

    # --- control API --------------------------------------------------------------------------
    async def takeover(self, request_id: str) -> None:
        """MD is gone: stream everything and finish here (RLD decodes on regardless).

        The router may learn MD is gone before P's KV reached this relay (MD dies early,
        the fast path is slow): the takeover then waits for the request, as MD's handoff
        does, instead of being refused and lost, which left the relay's stream stopped
        at the handoff point for a request nobody else would finish."""
        try:
            _, session = await self._session(request_id)
        except TimeoutError:
            raise NoSuchRequestError(request_id) from None
        tracing.event(
            "pdd.takeover", {"pdd.streamed_tokens": session.emitted},
            on=self._decode_spans.get(request_id),
        )  # fmt: skip
        session.unlimit()

    async def stop_request(self, request_id: str) -> None:
        entry = self.sessions.get(request_id)
        if entry is None:
            raise NoSuchRequestError(request_id)
        self.runner.unsubscribe(request_id)
        await self.abort_engine_request(request_id)
        entry[1].end_silently()
