"""Prefill (P): prefill what its own cache misses, then ship KV on two paths at once.

Per request: announce it to the decode-side receivers (each answers how much of the
prompt it already holds, and locks it) while prefilling, and stream the KV each
receiver lacks as the prefill writes it (each prefill chunk's KV goes on the line
when its step ends, so the transfer overlaps the chunks after it): all of it to the
relay over the fast path, only the main decode's miss over the WAN, each followed by
the first token as soon as the last chunk is written. Across the WAN nothing waits a
round trip: the channel to MD is a warm one from ``channel_pool`` (no connect, no TLS or
HMAC handshake per request; the relay's channels are pooled too, since on a busy
machine a handshake waits on both ends' event loops), and the KV starts from the
router's predicted MD hit (``PipelinePlan.main_hit_tokens``) unless MD's answer is
already in; MD's real hit, when it comes, makes P skip chunks MD holds and send the
gap MD lacks below the prediction. P never streams a token to the client: the first
token the client sees comes from a decode-side instance. P holds the request's KV until
both transfers have ended, however they ended. The WAN copy is coded with the codec the
plan names (the router's choice per request under ``--kv-codec adaptive``) or else the
deployment's (``--kv-codec``), named in the handshake; the relay's copy stays exact.

P's own stream carries one thing: a status event when the KV could not cross the
WAN to MD (refused, reset, no answer to the request within the connect timeout,
or stalled mid-transfer). MD cannot say so quickly: across a cut it never hears of
the request and gives up only after its transfer timeout. P knows within its own
connect timeout, so the router hears it from P and recovers (or lets the relay
finish) seconds earlier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pdd.common import tracing
from pdd.common.kv_codec import (
    NO_CODEC,
    KVCodec,
    chunk_wire_bytes,
    default_codec,
    handshake_name,
)
from pdd.common.vocabulary import LinkFault, Pipeline, Role
from pdd.common.wire import Endpoint, KVShipment, PipelinePlan, TokenEvent, TokenLogprobs
from pdd.worker.engine import Engine
from pdd.worker.engine.isolation import fault_of
from pdd.worker.engine.request import RequestFailedError, RequestOutput
from pdd.worker.roles.base import NoSuchRequestError, RoleBase, sampling_params
from pdd.worker.roles.protocol import (
    Imported,
    KVDone,
    Prepare,
    Prepared,
    ProtocolError,
    expect_meta,
    send_error,
    send_kv_done,
    send_meta,
)
from pdd.worker.transport import (
    Channel,
    LinkDown,
    MsgType,
    TransferTimeout,
    request_key,
)
from pdd.worker.transport.pool import ChannelPool, SpareOpener

log = logging.getLogger(__name__)

PREFILL_PIPELINES = (Pipeline.P_RLD_MD, Pipeline.P_MD, Pipeline.P_RLD, Pipeline.NAIVE)

#: On P-MD a prefill chunk ends this share of the step budget (``--max-num-batched-tokens``)
#: past the first token MD lacks (its predicted hit), and the chunks after it are whole.
#: The first token waits for MD's miss to cross, which starts when the step that writes
#: its first KV ends: where the line is slower than the prefill, as a WAN line usually is,
#: the transfer then ends that much sooner; where it is faster, the cost is one more step.
P_MD_FIRST_CHUNK_SHARE = 1 / 8


def chunk_break(plan: PipelinePlan, step_budget: int) -> int | None:
    """Where a prefill chunk of ``plan``'s prompt ends early (None: nowhere)."""
    if plan.pipeline != Pipeline.P_MD:
        return None  # the first token does not wait for KV on the WAN
    return (plan.main_hit_tokens or 0) + max(1, int(step_budget * P_MD_FIRST_CHUNK_SHARE))


@dataclass(frozen=True)
class Prefilled:
    first_token: int
    cached_tokens: int  # prompt tokens P's prefix cache supplied (not prefilled)
    first_logprobs: TokenLogprobs | None = None  # where the request asked for logprobs


@dataclass(frozen=True)
class Target:
    endpoint: Endpoint
    role: Role
    wan: bool

    @property
    def path(self) -> str:
        return "wan" if self.wan else "fast"


def targets_of(plan: PipelinePlan) -> list[Target]:
    """Who gets KV: the relay over the fast path, the main decode over the WAN."""
    out = []
    if plan.relay is not None and plan.pipeline in (Pipeline.P_RLD_MD, Pipeline.P_RLD):
        out.append(Target(plan.relay, Role.RELAY, wan=False))
    if plan.main is not None and plan.pipeline in (
        Pipeline.P_RLD_MD,
        Pipeline.P_MD,
        Pipeline.NAIVE,
    ):
        out.append(Target(plan.main, Role.MAIN, wan=True))
    return out


def link_fault_of(exc: BaseException, handshake: bool) -> LinkFault | None:
    """What a failed transfer says about the line, or None where it says nothing about it
    (MD refused the request, a secret or certificate mismatch: MD reports those itself).
    No answer within the timeout is a cut while connecting, a stall once bytes flowed;
    so is MD hanging up instead of answering (its own timeout fired first)."""
    if isinstance(exc, LinkDown):
        return LinkFault.UNREACHABLE
    if isinstance(exc, TransferTimeout | ProtocolError):
        return LinkFault.UNREACHABLE if handshake else LinkFault.STALLED
    return None


class _ShipClock:
    """One transfer's timing at P: when its first chunk went on the line, KV bytes sent."""

    def __init__(self) -> None:
        self.first_sent_at: float | None = None
        self.kv_bytes = 0
        #: The whole transfer's bytes (never reset by ``waited``): its span's figures.
        self.total_kv_bytes = 0
        self.wire_bytes = 0

    def sending(self, tokens: int, bytes_per_token: int) -> None:
        if self.first_sent_at is None:
            self.first_sent_at = asyncio.get_running_loop().time()
        self.kv_bytes += tokens * bytes_per_token

    def waited(self) -> None:
        """P waited for the prefill to write more KV: the line may have idled, so the
        timing starts again from the next chunk. (Bytes sent before and still crossing
        only make the rest look slower, and the router takes P's timing only where it
        shows the line faster than it believed.)"""
        self.first_sent_at = None
        self.kv_bytes = 0


@dataclass(frozen=True)
class _Sending:
    """One transfer in progress: to whom, on which channel, in which codec, and the
    futures it watches (the receiver's answer, P's prefill)."""

    request_id: str
    target: Target
    channel: Channel
    answer: asyncio.Future[int]
    codec: KVCodec
    clock: _ShipClock
    prefill: asyncio.Future[Prefilled | None]


#: A chunk of KV read for sending: its end (a token position) and its bytes.
_Chunk = tuple[int, bytes]


def _written_chunk(
    request_id: str, first: int, end: int, chunk_tokens: int, codec: KVCodec
) -> Callable[[Engine], _Chunk | None]:
    """On the engine thread: the next chunk of ``[first, end)`` the prefill has written
    (read in the same call, so no step can preempt the request in between), as
    ``(its end, its bytes)``; None while nothing past ``first`` is written."""

    def take(engine: Engine) -> _Chunk | None:
        written = min(engine.computed_tokens(request_id), end)
        if written <= first:
            return None
        last = min(first + chunk_tokens, written)
        return last, next(engine.export_kv(request_id, first, last, last - first, codec))

    return take


def _done_message(prefilled: Prefilled | None) -> KVDone:
    """``KV_DONE``: P's first token, its prefix hit and the token's logprobs; all None
    where MD prefills (P computed nothing)."""
    if prefilled is None:
        return KVDone(first_token=None, cached_tokens=None, first_logprobs=None)
    return KVDone(
        first_token=prefilled.first_token,
        cached_tokens=prefilled.cached_tokens,
        first_logprobs=prefilled.first_logprobs,
    )


def with_seed(plan: PipelinePlan) -> PipelinePlan:
    """Fix the seed here, so every instance that samples this request draws the same."""
    if plan.sampling.seed is not None:
        return plan
    sampling = plan.sampling.model_copy(update={"seed": secrets.randbits(63)})
    return plan.model_copy(update={"sampling": sampling})


def _known(answer: asyncio.Future[int]) -> int | None:
    """The receiver's hit if its answer already came (successfully), else None."""
    if answer.done() and not answer.cancelled() and answer.exception() is None:
        return answer.result()
    return None


def _errored(future: asyncio.Future) -> bool:
    """The future ended with an error (not cancelled)."""
    return future.done() and not future.cancelled() and future.exception() is not None


async def _pass_on(channel: Channel, rid: str, exc: BaseException | None) -> None:
    """Tell the receiver that the request's own work failed in P's engine (the ERROR
    code is its ``error_type``, ``fault_of``): it ends the request with that error,
    blaming no instance, rather than blame P for a channel that just closed."""
    error_type = fault_of(exc)
    if error_type is not None:
        with contextlib.suppress(Exception):  # the channel may be gone already
            await send_error(channel, rid, error_type, str(exc))


def _refusal(answer: asyncio.Future[int]) -> BaseException | None:
    """Why the receiver's answer failed (an ERROR it sent, a timeout), if it did."""
    if answer.done() and not answer.cancelled():
        return answer.exception()
    return None


class PrefillRole(RoleBase):
    role = Role.PREFILL

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Warm channels to each MD across the WAN and to each relay on the fast path
        #: (``ChannelPool``: why a pool).
        self.channel_pool = ChannelPool()
        #: Each live request's work (``_prefill_and_ship``), so a cancel stops it in any state.
        self._works: dict[str, asyncio.Future] = {}

    async def close(self) -> None:
        await super().close()
        await self.channel_pool.close()

    async def start_request(self, plan: PipelinePlan) -> None:
        if plan.pipeline not in PREFILL_PIPELINES:
            raise ValueError(f"a prefill instance runs {PREFILL_PIPELINES}, not {plan.pipeline}")
        if plan.request_id in self.live:
            raise ValueError(f"request {plan.request_id!r} is already running here")
        self.cancelled.check(plan.request_id)  # its cancel overtook it
        self.live.add(plan.request_id)
        if plan.ships_kv_over_wan:
            self.hub.get(plan.request_id).start()  # its reader waits for a report or the end
        self.spawn(self._run(with_seed(plan)), f"prefill-{plan.request_id}")

    async def stop_request(self, request_id: str) -> None:
        """Stop the request's work wherever it is: queued for prefill (the engine's abort
        alone would leave it waiting for a first token that never comes), shipping KV
        (the receivers see the channel close and let go), or waiting for an answer.
        Only the work is cancelled, never the run's cleanup (``_run``), which then aborts
        the request in the engine, freeing its KV, and forgets it."""
        work = self._works.get(request_id)
        if work is None:
            raise NoSuchRequestError(request_id)
        work.cancel()

    async def _run(self, plan: PipelinePlan) -> None:
        """The request's work, then, however it ended, its cleanup."""
        rid = plan.request_id
        work = asyncio.ensure_future(self._prefill_and_ship(plan))
        self._works[rid] = work
        try:
            await asyncio.wait({work})
            failure = None if work.cancelled() else work.exception()
            if fault_of(failure) is not None:  # the request's doing, not P's: no stack
                log.warning("prefill of %s failed: %s", rid, failure)
            elif failure is not None:
                log.error("prefill of %s failed", rid, exc_info=failure)
        finally:
            work.cancel()  # the run itself was cancelled (the worker is closing)
            del self._works[rid]
            await self.abort_engine_request(rid)  # releases the held KV (finished or not)
            self.runner.unsubscribe(rid)
            self.live.discard(rid)
            if plan.ships_kv_over_wan:
                self.hub.get(rid).close()  # the router's reader of P's reports stops

    async def _prefill_and_ship(self, plan: PipelinePlan) -> None:
        """Prefill and each path run at once; a slow WAN handshake never delays the relay.
        Where MD prefills (``PipelinePlan.md_prefills``) P computes nothing: its "prefill"
        is done at once, with no first token."""
        attributes = {tracing.REQUEST_ID: plan.request_id, "pdd.pipeline": str(plan.pipeline)}
        with tracing.span("pdd.prefill.request", plan.trace_context, attributes):
            await self._prefill_and_ship_traced(plan)

    async def _prefill_and_ship_traced(self, plan: PipelinePlan) -> None:
        prefill: asyncio.Future[Prefilled | None]
        if plan.md_prefills:
            prefill = asyncio.get_running_loop().create_future()
            prefill.set_result(None)
        else:
            prefill = asyncio.ensure_future(self._prefill(plan))
        try:
            paths = [self._path(plan, t, prefill) for t in targets_of(plan)]
            await asyncio.gather(prefill, *paths)
        finally:
            prefill.cancel()

    async def _path(self, plan: PipelinePlan, target: Target, prefill: asyncio.Future) -> None:
        """One receiver: open (or take a warm) channel, announce the request, ship its miss.

        The receiver's answer (its hit) is awaited before any KV only where P has no
        prediction of it: across the WAN the router's prediction saves that round trip."""
        codec = self._wan_codec(plan) if target.wan else NO_CODEC
        attributes = {
            tracing.REQUEST_ID: plan.request_id, "pdd.kv.path": target.path,
            "pdd.kv.peer": target.endpoint.instance_id, "pdd.kv.codec": handshake_name(codec),
        }  # fmt: skip
        with tracing.span("pdd.kv_transfer", attributes=attributes):
            await self._path_traced(plan, target, prefill, codec)

    async def _path_traced(
        self, plan: PipelinePlan, target: Target, prefill: asyncio.Future, codec: KVCodec
    ) -> None:
        try:
            channel = await self._channel(target)
        except Exception as exc:
            self._failed(plan, target, "handshake with", exc, handshake=True)
            return
        try:
            prepare = Prepare(
                request_id=plan.request_id, plan=plan, codec=handshake_name(codec),
                trace=tracing.carrier(),
            )  # fmt: skip
            await send_meta(channel, prepare)
        except Exception as exc:
            await self._release(target, channel, reusable=False)
            self._failed(plan, target, "handshake with", exc, handshake=True)
            return
        reusable = False
        answer = asyncio.ensure_future(self._answer(channel, codec))
        try:
            reusable = await self._ship(plan, target, channel, answer, prefill, codec)
        finally:
            answer.cancel()
            with contextlib.suppress(BaseException):
                await answer
            await self._release(target, channel, reusable)

    def _wan_codec(self, plan: PipelinePlan) -> KVCodec:
        """The codec the router chose for this transfer (``spec.wan.kvCodec: adaptive``),
        else the deployment's."""
        if plan.kv_codec is not None:
            return plan.kv_codec
        return default_codec(self.settings.kv_codec)

    async def _channel(self, target: Target) -> Channel:
        """A warm pooled channel to the receiver (MD across the WAN, a relay on the fast
        path)."""
        opener = self._opener(target.endpoint, target.role, target.wan)
        return await self.channel_pool.take_warm(target.endpoint.instance_id, opener)

    def warm_wan_peers(self, main_decodes: list[Endpoint]) -> list[asyncio.Task[None]]:
        """Open a spare channel to each main decode the router names, before its first
        request there, which would otherwise pay the connect and the handshake's round
        trips across the WAN (TLS's too, where it is on) on top of its own. Returns the
        tasks opening them (``ChannelPool.warm``)."""
        return [task for endpoint in main_decodes for task in self._warm(endpoint)]

    def _warm(self, endpoint: Endpoint) -> list[asyncio.Task[None]]:
        """Keep the pool's spare channels to MD ``endpoint`` open (a no-op when they are)."""
        opener = self._opener(endpoint, Role.MAIN, wan=True)
        return self.channel_pool.warm(endpoint.instance_id, lambda: opener(True))

    def _opener(self, endpoint: Endpoint, role: Role, wan: bool) -> SpareOpener:
        """Opens a channel to ``endpoint`` (``ChannelPool.take_warm``)."""

        def opener(spare: bool) -> Awaitable[Channel]:
            return self.open_channel(endpoint, role, wan=wan, sends=True, spare=spare)

        return opener

    async def _release(self, target: Target, channel: Channel, reusable: bool) -> None:
        """A channel whose conversation ended cleanly goes back to the pool."""
        channel.settle()
        await self.channel_pool.release(target.endpoint.instance_id, channel, reusable)

    async def _prefill(self, plan: PipelinePlan) -> Prefilled:
        """Prefill the prompt (only P's miss is computed) and sample the first token."""
        first: asyncio.Future[Prefilled] = asyncio.get_running_loop().create_future()

        def on_output(out: RequestOutput) -> None:
            if out.error is not None and not first.done():
                first.set_exception(RequestFailedError(out.error, out.error_type))
            elif out.new_token_ids and not first.done():
                self.metrics.observe_first_token(out)
                lp = out.logprobs[0] if out.logprobs else None
                first.set_result(Prefilled(out.new_token_ids[0], out.num_cached_tokens, lp))

        params = sampling_params(plan, max_tokens=1)
        with tracing.span("pdd.prefill", attributes={"pdd.prompt_tokens": len(plan.prompt_ids)}):
            prefilled = await self._prefill_first(plan, params, first, on_output)
            tracing.set_attributes({"pdd.cached_tokens": prefilled.cached_tokens})
        self.metrics.count_prompt(len(plan.prompt_ids), prefilled.cached_tokens)
        return prefilled

    async def _prefill_first(
        self, plan: PipelinePlan, params: Any, first: asyncio.Future[Prefilled],
        on_output: Callable[[RequestOutput], None],
    ) -> Prefilled:  # fmt: skip
        """Queue the prompt in the engine and wait for its first token."""
        self.runner.subscribe(plan.request_id, on_output)
        await self.runner.call(
            lambda e: e.add_request(
                plan.prompt_ids, params, plan.request_id, hold_kv=True,
                chunk_break=chunk_break(plan, e.config.max_num_batched_tokens),
            )
        )  # fmt: skip
        return await first

    async def _answer(self, channel: Channel, codec: KVCodec) -> int:
        """The receiver's answer to ``prepare``: the prefix it holds (and locked); it names
        the codec it takes, which must be the one offered."""
        # Answering "prepare" only locks a prefix: a reply slower than a connect is a
        # line that is not there, reported as such (not after the transfer timeout).
        timeout_s = self.settings.transport.connect_timeout_s
        try:
            prepared = await expect_meta(channel, Prepared, timeout_s=timeout_s)
        except TransferTimeout:
            raise TransferTimeout(
                f"{channel.peer.name} did not answer the request within {timeout_s}s (timed "
                "out): the line is cut or the peer is stuck"
            ) from None
        if prepared.codec != handshake_name(codec):
            raise ProtocolError(
                f"{channel.peer.name} takes KV coded {prepared.codec!r}, this prefill "
                f"sends {handshake_name(codec)!r}; give P and MD the same "
                "spec.wan.kvCodec (--kv-codec) and the same build"
            )
        return prepared.hit

    async def _ship(
        self, plan: PipelinePlan, target: Target, channel: Channel, answer: asyncio.Future[int],
        prefill: asyncio.Future[Prefilled | None], codec: KVCodec,
    ) -> bool:  # fmt: skip
        """Send the receiver's miss as the prefill writes it, then the first token; True
        when it imported all of it. Where MD computes its miss (``md_computes_miss``) only
        the first token goes; where MD prefills (``md_prefills``), not even that.

        Across the WAN with a predicted hit the KV starts from the receiver's answer if it
        already came, else from the prediction; chunks the answer shows it holds are then
        skipped, and what it lacks below the prediction (the gap) follows the rest."""
        rid, n = plan.request_id, len(plan.prompt_ids)
        predicted = plan.main_hit_tokens if target.wan else None
        computes = target.wan and plan.md_computes_miss  # MD computes its miss: no KV
        if predicted is None and not await self._answered(plan, target, channel, answer):
            return False
        try:
            start = _known(answer)
            start = min(predicted or 0, n) if start is None else start
            clock = _ShipClock()
            send = _Sending(rid, target, channel, answer, codec, clock, prefill)
            if computes:  # no KV: the first token (if any) follows, without the answer's RTT
                await send_kv_done(channel, rid, _done_message(await asyncio.shield(prefill)))
                await asyncio.shield(answer)
            else:
                await self._send_kv(send, start, n)
                prefilled = await asyncio.shield(prefill)
                hit = await asyncio.shield(answer)
                if hit < start:  # MD holds less than predicted: [hit, start)
                    await self._send_kv(send, hit, start)
                await send_kv_done(channel, rid, _done_message(prefilled))
            await expect_meta(channel, Imported)
            tracing.set_attributes(
                {"pdd.kv.start_token": start, "pdd.kv.raw_bytes": clock.total_kv_bytes,
                 "pdd.kv.wire_bytes": clock.wire_bytes, "pdd.kv.md_computes": computes}
            )  # fmt: skip
            if target.wan:
                self._shipped(plan, clock)
        except Exception as exc:
            if _errored(prefill):  # a failed prefill is no transfer failure: nothing to
                await _pass_on(channel, rid, prefill.exception())  # say of the line
                raise
            if not answer.done() and not channel.is_open:
                await asyncio.wait({answer})  # a failed channel fails it at once
            cause = _refusal(answer) or exc  # the receiver's own answer says why, if it came
            handshake = _known(answer) is None
            verb = "handshake with" if handshake else f"KV ({target.path}) to"
            self._failed(plan, target, verb, cause, handshake)
            return False
        return True

    async def _answered(
        self, plan: PipelinePlan, target: Target, channel: Channel, answer: asyncio.Future[int]
    ) -> bool:
        """Wait for the receiver's answer (no prediction to start from); False if it failed."""
        try:
            await asyncio.shield(answer)
        except Exception as exc:
            self._failed(plan, target, "handshake with", exc, handshake=True)
            return False
        return True

    async def _send_kv(self, send: _Sending, start: int, end: int) -> None:
        """KV of ``[start, end)`` as the prefill writes it: whatever part of the range the
        engine has computed goes on the line at once (in chunks of at most
        ``chunk_bytes``), so the transfer overlaps the prefill's later chunks and only the
        last one's KV follows its step. What the receiver's answer says it holds is
        skipped. A refusal from the receiver stops the transfer, as does a failed prefill."""
        if start >= end:
            return
        rid, channel, codec = send.request_id, send.channel, send.codec
        key = request_key(rid)
        counter = self.metrics.wan_bytes if send.target.wan else self.metrics.fastpath_bytes
        chunk_tokens = max(1, self.settings.chunk_bytes // self._bytes_per_token - 1)
        channel.commit(self._coded_bytes(start, end, codec))  # the backlog
        first = start
        while first < end:
            refused = _refusal(send.answer)
            if refused is not None:  # the receiver said no (or is gone): stop sending
                raise refused
            held = _known(send.answer)
            if held is not None and channel.has_inbound:
                # After its answer a receiver says nothing until "imported": this is its
                # ERROR (a chunk it could not take), or the channel's failure. Stop here
                # rather than stream the rest of the prefill into a refusal.
                await expect_meta(channel, Imported)
            if held is not None and held > first:  # the receiver holds these: skip them
                skipped = min(held, end)
                channel.commit(-self._coded_bytes(first, skipped, codec))  # never sent
                first = skipped
                continue
            ended = send.prefill.done()  # before the read: a step may end it meanwhile
            take = _written_chunk(rid, first, end, chunk_tokens, codec)
            taken = await self.runner.call(take)
            if taken is None:  # the prefill has not written KV past ``first`` yet
                if ended:
                    send.prefill.result()  # raises the prefill's own error
                    raise RuntimeError("the prefill ended without the KV it was to write")
                taken = await self._next_write(send.prefill, take)
                send.clock.waited()  # the line may idle meanwhile: time it afresh
                if taken is None:
                    continue
            last, blob = taken
            send.clock.sending(last - first, self._bytes_per_token)
            await channel.send(MsgType.KV_CHUNK, key, blob)
            send.clock.total_kv_bytes += (last - first) * self._bytes_per_token
            send.clock.wire_bytes += len(blob)
            counter.inc((last - first) * self._bytes_per_token)
            if send.target.wan:
                self.metrics.wan_kv_wire_bytes.inc(len(blob))
            first = last

    async def _next_write(
        self, prefill: asyncio.Future[Prefilled | None], take: Callable[[Engine], _Chunk | None]
    ) -> _Chunk | None:
        """``take`` run as the engine's next step ends (``after_next_step``: the chunk that
        step wrote is read before the engine starts the next one, so the line carries it
        while the next computes), or None when the prefill ended first (its last step
        wrote all of it); a failed prefill raises its error."""
        if prefill.done():
            prefill.result()  # raises the prefill's own error
            return None
        after = self.runner.after_next_step(take)
        racing: set[asyncio.Future[Any]] = {after, prefill}
        try:
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not after.done():
                after.cancel()
        if _errored(prefill):
            prefill.result()
        return after.result() if after.done() and not after.cancelled() else None

    def _shipped(self, plan: PipelinePlan, clock: _ShipClock) -> None:
        """Tell the router on P's stream that MD imported the KV, and how long the line
        took: its goodput sample, free of the prefill and queues its own timing holds."""
        if clock.first_sent_at is None:
            return  # MD held it all: nothing crossed, nothing to time
        shipment = KVShipment(
            kv_bytes=clock.kv_bytes,
            seconds=asyncio.get_running_loop().time() - clock.first_sent_at,
        )
        report = TokenEvent(
            request_id=plan.request_id, seq=0, source=self.hub.source, kv_shipped=shipment
        )
        self.hub.get(plan.request_id).push(report)

    def _failed(
        self, plan: PipelinePlan, target: Target, verb: str, exc: BaseException, handshake: bool
    ) -> None:
        """Count and log a transfer that did not complete, and report it on P's stream."""
        self.metrics.transfer_failures.labels(target.path).inc()
        tracing.event("pdd.transfer_failed", {"pdd.error": f"{verb} failed: {exc}"})
        log.warning(
            "%s %s for %s failed: %s", verb, target.endpoint.instance_id, plan.request_id, exc
        )
        self._report(plan, target, exc, handshake)

    def _report(
        self, plan: PipelinePlan, target: Target, exc: BaseException, handshake: bool
    ) -> None:
        """Tell the router on P's stream, at once, that MD will not get this request's KV
        over the line (MD itself would say so only after its transfer timeout)."""
        fault = link_fault_of(exc, handshake)
        if not target.wan or fault is None:
            return
        md = target.endpoint.instance_id
        self.hub.fail(
            plan.request_id,
            0,
            f"{self.settings.instance_id} could not send the KV to {md} over the WAN "
            f"({fault}): {exc}",
            culprit=md,
            link_fault=fault,
        )

    def _coded_bytes(self, start: int, end: int, codec: KVCodec) -> int:
        """Payload bytes of positions ``start..end`` (the same in any chunking: the codecs
        scale each token on its own)."""
        lay = self.runner.engine.layout
        return chunk_wire_bytes(
            codec, lay.num_layers, end - start, lay.num_kv_heads, lay.head_dim, lay.itemsize
        )

    @property
    def _bytes_per_token(self) -> int:
        return self.runner.engine.layout.bytes_per_token
