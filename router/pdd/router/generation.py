"""One routed request as text: worker token events in, text deltas out, metrics on the way.

The merged token stream (``stream_relay``) is turned into text incrementally, cut at
the client's stop strings (the workers only know stop token IDs), and timed where
the client sees it. The request's in-flight lease on P is released at the first
token (P's part is over by then), when MD starts counting it in full (until then it is
pending there: ``Lease.main_reached``); the rest when the stream ends, however it ends.

A worker that fails the request (a dead P, an MD or RLD whose stream breaks, an MD
P could not reach over the WAN) is left out and the request routed again, or resumed
after the tokens already sent, so a client never sees a failure another instance
could have absorbed. What the request learns of the WAN line (P's KV could not cross;
MD streams, so it did) goes to the router's ``LinkHealth``.

The workers measure what the router only estimated: the prefix hit P really had
(reported to the client as ``cached_tokens``) and, once MD streams, that the prompt
landed there. What MD caches (the prompt once its KV landed, then the answer) goes
into the prefix index at once, before MD's own cache events could say so: the
conversation's next turn often comes sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from pdd.common import tracing
from pdd.common.vocabulary import FinishReason
from pdd.common.wire import KVShipment, PipelinePlan, TokenEvent, TokenLogprobs
from pdd.router import access_log
from pdd.router.detokenize import IncrementalDetokenizer, StopStrings
from pdd.router.dispatcher import Attempt
from pdd.router.errors import UpstreamError
from pdd.router.lease import Lease
from pdd.router.openai_protocol import UsageInfo
from pdd.router.prefix_index import PrefixIndex
from pdd.router.route import Route
from pdd.router.runtime import RouterRuntime
from pdd.router.stream_relay import relay_tokens

log = logging.getLogger(__name__)

#: How many times one request is recovered (re-dispatched or resumed).
MAX_RECOVERIES = 2


#: One output token and its logprobs, as the instance that sampled it reported them.
TokenLogprobEntry = tuple[int, TokenLogprobs]


@dataclass(frozen=True)
class TextDelta:
    """New text, and the logprobs of the tokens that arrived since the last delta (when
    the request asked for them: text can lag its tokens, never the other way)."""

    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobEntry, ...] = ()


@dataclass
class MeasuredHits:
    """The prefix hits the workers measured for one request, taken from its token events."""

    index: PrefixIndex
    plan: PipelinePlan
    cached_tokens: int = 0  # prompt tokens the computing instance took from its cache
    prompt_hashes: Sequence[int] | None = None  # the route's, when known (saves re-hashing)
    #: MD keeps this request's KV in its prefix cache (``Route.fills_main_cache``).
    main_caches: bool = False

    def observe(self, event: TokenEvent) -> None:
        if event.cached_tokens is not None:
            self.cached_tokens = min(event.cached_tokens, len(self.plan.prompt_ids))
        if event.md_hit_tokens is not None and self.main_caches and self.plan.main is not None:
            # MD streams, so the whole prompt has landed there and is cached, whatever it
            # held at the handshake (``md_hit_tokens``, the usage report's figure).
            hashes = self.prompt_hashes or self.index.hashes(self.plan.prompt_ids)
            self.index.confirm(self.plan.main.instance_id, hashes, len(self.plan.prompt_ids))

    def answered(self, output_ids: Sequence[int]) -> None:
        """The request ended: MD caches the conversation so far, prompt and answer (it
        decoded the answer, or computed it from the relay's IDs where the relay finished
        it), and the next turn extends it; count it as held before MD's events say so."""
        if self.main_caches and self.plan.main is not None:
            tokens = [*self.plan.prompt_ids, *output_ids[:-1]]  # the last has no KV on MD
            self.index.expect(self.plan.main.instance_id, self.index.hashes(tokens))


class Generation:
    def __init__(
        self,
        runtime: RouterRuntime,
        attempt: Attempt,
        stop: list[str],
        arrived_at: float,
    ) -> None:
        self.runtime = runtime
        self.prompt_tokens = len(attempt.plan.prompt_ids)
        self._max_tokens = attempt.plan.sampling.max_tokens
        self.completion_tokens = 0
        self.relayed_tokens = 0
        self.finish_reason: FinishReason | None = None
        #: Seconds from the request's arrival to its first output token (None before).
        self.ttft_s: float | None = None
        self._stops = StopStrings(stop)
        self._detok = IncrementalDetokenizer(runtime.tokenizer.tokenizer)
        self._arrived_at = arrived_at
        #: The request as first routed: what a recovery routes again (``_recover``).
        self._request = attempt.plan
        #: Set once the first output token arrived (the prompt's KV is in the prefix
        #: cache by then) or the request ended without one.
        self.past_prefill = asyncio.Event()
        #: Every output token's logprobs so far (the non-streaming response reads them).
        self.logprobs: list[TokenLogprobEntry] = []
        self._unsent_logprobs = 0  # of those, how many no delta has carried yet
        #: The request's trace id, as the exemplar of its TTFT sample and its first ITL
        #: sample (None: untraced, or already used).
        self._exemplar: dict[str, str] | None = None
        self._use(attempt)
        self._first_hits = self.hits
        record = access_log.current()
        if record is not None:
            record.add(self)

    def _use(self, attempt: Attempt) -> None:
        self.route, self.plan, self._lease = attempt.route, attempt.plan, attempt.lease
        self.hits = MeasuredHits(
            self.runtime.index,
            attempt.plan,
            prompt_hashes=attempt.route.prompt_hashes,
            main_caches=attempt.route.fills_main_cache,
        )

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the computing instance (P, or mono) took from its prefix cache
        (the first attempt's: a resumed one's prompt includes the output)."""
        return self._first_hits.cached_tokens

    @property
    def request_id(self) -> str:
        """The request's id as first routed (``x-pdd-request-id``; a recovery's plan
        adds a suffix): the access log's, where no response headers went out."""
        return self._request.request_id

    @property
    def pipeline(self) -> str:
        return self.route.pipeline

    @property
    def token_ids(self) -> list[int]:
        """The output token IDs the client has been sent so far."""
        return list(self._detok.ids)

    def release(self) -> None:
        """Give back the in-flight lease (idempotent): for a generation that may never be
        read (a sample cancelled before its stream began)."""
        self._lease.release_all()

    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    async def deltas(self) -> AsyncGenerator[TextDelta, None]:
        """The request's text. A failure that names the instances at fault is recovered,
        up to ``MAX_RECOVERIES`` times, invisibly to the client: before the first token by
        routing the request again without them (``redispatch``); after it by resuming on
        other instances from the prompt plus the tokens already sent (``resume``), so the
        stream goes on at the next position, none repeated and none missing (the new
        instances count the tokens sent as output, so greedy and seeded output is the
        same as without the failure)."""
        failed: set[str] = set()
        try:
            for attempt in itertools.count(1):
                try:
                    async with contextlib.aclosing(self._attempt()) as deltas:
                        async for delta in deltas:
                            yield delta
                    return
                except UpstreamError as exc:
                    if not self._may_recover(exc, attempt):
                        raise
                    failed.update(exc.failed)
                    await self._recover(exc, frozenset(failed), attempt)
        finally:
            self.past_prefill.set()
            if self.completion_tokens:
                share = self.relayed_tokens / self.completion_tokens
                self.runtime.metrics.relayed_share.observe(share)

    def _may_recover(self, exc: UpstreamError, attempt: int) -> bool:
        return (
            bool(exc.failed)
            and attempt <= MAX_RECOVERIES
            and len(self._detok.ids) < self._max_tokens  # else there is nothing left to do
        )

    async def _recover(self, exc: UpstreamError, exclude: frozenset[str], attempt: int) -> None:
        for instance_id in exc.failed:
            self.runtime.registry.suspect(instance_id, f"a request failed on it: {exc.message}")
        emitted = self.token_ids
        kind = "resume" if emitted else "redispatch"
        self.runtime.metrics.recoveries.labels(kind).inc()
        tracing.event(
            f"pdd.{kind}",
            {"pdd.failed": sorted(exc.failed), "pdd.emitted_tokens": len(emitted),
             "pdd.error": exc.message},
        )  # fmt: skip
        log.warning(
            "request %s failed after %d tokens (%s); %s without %s",
            self.plan.request_id,
            len(emitted),
            exc.message,
            "resuming from the tokens sent" if emitted else "re-dispatching",
            ", ".join(sorted(exclude)),
        )
        request = self._request
        retried = await self.runtime.dispatcher.attempt(
            request.prompt_ids,
            request.sampling,
            exclude,
            emitted,
            request_id=f"{request.request_id}-r{attempt}",
        )
        self._use(retried)

    async def _attempt(self) -> AsyncGenerator[TextDelta, None]:
        rt = self.runtime
        detok = self._detok
        relay_id = self.plan.relay.instance_id if self.plan.relay else None
        last: float | None = None
        lease, route = self._lease, self.route
        events = relay_tokens(
            self.plan, rt.client, rt.config.request_timeout_s,
            on_link_fault=self._link_fault,
            on_kv_shipped=functools.partial(self._kv_shipped, lease, route),
            on_reports_over=lease.release_line,  # the KV may cross after the request ended
        )  # fmt: skip
        try:
            async for event in events:
                if not event.is_token:  # the finish of a token that went out unfinished
                    yield self._finish("", False, event.finish_reason)
                    return
                now = time.monotonic()
                self.past_prefill.set()
                if last is None:
                    if self.completion_tokens == 0:
                        self.ttft_s = now - self._arrived_at
                        self._exemplar = _exemplar()
                        rt.metrics.ttft.observe(self.ttft_s, self._exemplar)
                    if self.plan.prefill is not None:
                        self._lease.release(self.plan.prefill.instance_id)
                        self._lease.main_reached()  # P's part is over: MD's begins
                    if relay_id is not None and event.source == relay_id:
                        self._prefill_seen(now)
                else:
                    # The trace id rides on the request's first gap only: an exemplar
                    # costs its validation on every observation that carries one.
                    rt.metrics.itl.observe(now - last, self._exemplar)
                    self._exemplar = None
                if self.plan.main is not None and event.source == self.plan.main.instance_id:
                    self._lease.kv_landed(now)  # MD streams: it has the KV
                    if self.route.ships_kv:
                        rt.link_health.delivered(self.route.link_ticket)
                last = now
                self.hits.observe(event)
                self._count(event.source == relay_id)
                if event.logprobs is not None:
                    self.logprobs.append((event.token_id, event.logprobs))  # type: ignore[arg-type]
                    self._unsent_logprobs += 1
                text, stopped = self._stops.feed(detok.push(event.token_id))  # type: ignore[arg-type]
                if stopped or event.finished:
                    yield self._finish(text, stopped, event.finish_reason)
                    return
                if text:
                    yield TextDelta(text, logprobs=self._take_logprobs())
        finally:
            await events.aclose()  # its end lets go of the line, or waits for P's report
            lease.release_all(keep_line=True)

    def _finish(self, text: str, stopped: bool, reason: FinishReason | None) -> TextDelta:
        """The last delta: ``text`` (the last token's, cut at a stop string if
        ``stopped``), then what the detokenizer and the stop-string matcher still hold."""
        if not stopped:
            tail, stopped = self._stops.feed(self._detok.finish())
            text += tail
        if not stopped and self.hits is self._first_hits:  # MD ran it to the end, unbroken
            self.hits.answered(self._detok.ids)
        self.finish_reason = "stop" if stopped else (reason or "stop")
        return TextDelta(
            text + ("" if stopped else self._stops.flush()),
            self.finish_reason,
            self._take_logprobs(),
        )

    def _take_logprobs(self) -> tuple[TokenLogprobEntry, ...]:
        """The entries no delta has carried yet."""
        n, self._unsent_logprobs = self._unsent_logprobs, 0
        return tuple(self.logprobs[len(self.logprobs) - n :]) if n else ()

    def _prefill_seen(self, now: float) -> None:
        """The relay streams P's first token: P's prefill (and its queue) is over."""
        assert self.plan.prefill is not None  # a route with a relay starts at P
        self.runtime.link_estimator.prefill_seen(
            self.plan.prefill.instance_id,
            self.route.prefill_tokens,
            now - self._lease.dispatched_at,
            self.route.relay_active,
        )

    def _kv_shipped(self, lease: Lease, route: Route, shipment: KVShipment) -> None:
        """P reports MD imported the KV, with the line's time for it: the goodput sample
        and the proof that the line works, even where a relay's hand-off (MD's first
        token) would come much later, or never (the relay finishes first: the report
        then comes after the request ended, for the attempt's own lease)."""
        lease.kv_shipped(shipment, time.monotonic())
        self.runtime.link_health.delivered(route.link_ticket)

    def _link_fault(self, report: TokenEvent) -> None:
        """P could not send this request's KV over the WAN: the line is in doubt."""
        assert report.link_fault is not None
        self.runtime.link_health.failed(report.link_fault, report.error or "")
        tracing.event(
            "pdd.link_fault",
            {"pdd.link.fault": report.link_fault.value, "pdd.failed": report.culprit or "",
             "pdd.error": report.error or ""},
        )  # fmt: skip

    def _count(self, from_relay: bool) -> None:
        self.completion_tokens += 1
        self.relayed_tokens += from_relay
        self.runtime.metrics.tokens_from["relay" if from_relay else "main"].inc()


def _exemplar() -> dict[str, str] | None:
    """``{"trace_id": ...}`` of the request being served, where it is traced: a
    histogram's slow bucket then links to a trace (OpenMetrics exemplars)."""
    trace_id = tracing.trace_id_hex()
    return None if trace_id is None else {"trace_id": trace_id}
