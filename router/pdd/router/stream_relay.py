"""One request's token streams, from every decode-side worker, merged into one.

The relay (RLD) streams the first tokens and the main decode (MD) continues after
the handoff; every token carries its output position, so ``TokenStreamMerger``
releases each position exactly once, in order. A decode-side source that breaks
is routed around (RLD gone before the handoff: hand MD the IDs the client already
has; MD gone: tell RLD to take over); one that reports the request's own failure
(``TokenEvent.error_type``: its grammar, its sampling) ends it, since any instance
would fail it alike. Where P ships KV across the WAN, P's stream is
read too: it reports at once a transfer to MD that failed on the line, so a relay on
the route takes over, and a request without one fails now (naming MD, for the
router's retry) rather than after MD's transfer timeout; and it reports that MD
imported the KV, timed at P. Where a relay finished the request before that report,
P's stream is read on in the background until it comes (bounded by the request's
deadline): the KV is still crossing the line, and the router counts it there until
then. Whenever the stream ends before the request finished (client disconnect,
timeout, failure), the request is cancelled on every worker it touched, so their KV
and locks are freed: after its start at the entry has settled (a cancel sent first
would find nothing there), and retried where the connection failed. The readers are
stopped as ``StoppableTask``s, so a stop never cuts httpx's close of a response short
(which left the connection's socket open for good).

The merged stream runs at its client's pace: the events read ahead of it wait in a
buffer of ``STREAM_BUFFER_EVENTS``; once that is full the readers stop reading the
workers' streams (TCP holds the rest back; the workers keep what they generated, as
they do for every request). So a client that reads slowly holds at most that many
events in the router, plus the server's write buffer, however long its answer, and
nobody else waits for it: each request has its own buffer and readers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from pdd.common import tracing
from pdd.common.grammar import GRAMMAR_ERROR_TYPE
from pdd.common.vocabulary import Pipeline
from pdd.common.wire import (
    REQUEST_TOO_LARGE_ERROR_TYPE,
    Endpoint,
    KVShipment,
    PipelinePlan,
    TokenEvent,
)
from pdd.router.errors import (
    InvalidRequestError,
    RequestTooLargeError,
    RouterError,
    UpstreamError,
)
from pdd.router.stoppable import StoppableTask
from pdd.router.token_stream import TokenStreamMerger
from pdd.router.worker_client import WorkerCallError, WorkerClient

log = logging.getLogger(__name__)

#: Cleanup tasks outlive the request that spawned them; keep them referenced.
_background: set[asyncio.Task] = set()

#: Events one request's merged stream holds ahead of its client (see the module's note).
#: An event is one token's line (with its logprobs, if asked), so the bytes are bounded too.
STREAM_BUFFER_EVENTS = 64
#: After a request's last token, how long its readers may go on to read their streams'
#: ends (the worker ends each right after the last event): a stream read to its end leaves
#: its connection in the pool, one stopped short of it closes the connection, and the next
#: request to that worker pays a new one (with WAN TLS to MD: a handshake across the WAN).
STREAM_END_GRACE_S = 1.0
#: Every live request's buffer, for ``fullest_buffer``.
_buffers: set[asyncio.Queue] = set()


def fullest_buffer() -> int:
    """Events the fullest live buffer holds now (at most ``STREAM_BUFFER_EVENTS``)."""
    return max((q.qsize() for q in _buffers), default=0)


@dataclass(frozen=True)
class _StreamEnd:
    source: str
    broken: str | None


#: Told of each transfer P reports failed on the WAN line (``TokenEvent.link_fault``).
LinkFaultListener = Callable[[TokenEvent], None]
#: Told of P's report that MD imported its KV, timed at P (``TokenEvent.kv_shipped``).
KVShippedListener = Callable[[KVShipment], None]
#: Told once P's reports are over: its report came, its stream ended, or nobody waits.
ReportsOverListener = Callable[[], None]


async def relay_tokens(
    plan: PipelinePlan,
    client: WorkerClient,
    timeout_s: float,
    merger: TokenStreamMerger | None = None,
    on_link_fault: LinkFaultListener | None = None,
    on_kv_shipped: KVShippedListener | None = None,
    on_reports_over: ReportsOverListener | None = None,
) -> AsyncGenerator[TokenEvent, None]:
    """Start ``plan`` and yield its merged tokens; raises ``UpstreamError`` on failure.
    The last event is finished: a token, or a finish event with no token where the
    last token went out before its instance knew it was the last (``TokenEvent``).
    ``on_reports_over`` is called exactly once, when the stream is closed or, where P's
    report on a finished request's KV is still to come, once that wait is over.

    ``merger``, when given, is the one used, so its counters (``duplicates``, ``errors``)
    can be read afterwards.
    """
    queue: asyncio.Queue[TokenEvent | _StreamEnd] = asyncio.Queue(STREAM_BUFFER_EVENTS)
    _buffers.add(queue)
    watched = list(plan.decode_sources)
    if plan.ships_kv_over_wan:
        watched.append(plan.prefill)  # type: ignore[arg-type]  # its reports, no tokens
    readers = [StoppableTask(_read(client, ep, plan.request_id, queue)) for ep in watched]
    merger = merger or TokenStreamMerger(plan.request_id)
    deadline = asyncio.get_running_loop().time() + timeout_s
    p_reported = asyncio.Event()  # P's report (or its stream's end) was read
    listeners = (on_link_fault, on_kv_shipped)
    entry = plan.main if plan.pipeline == "mono" else plan.prefill
    assert entry is not None  # PipelinePlan's validator guarantees it
    # Its own task, so a client gone mid-POST does not abort it half-sent: the cancel
    # below waits for it and so reaches the entry after the plan, never before.
    started = asyncio.create_task(client.start(entry.http_url, plan))
    try:
        try:
            await asyncio.shield(started)
        except WorkerCallError as exc:
            if exc.error_type == GRAMMAR_ERROR_TYPE:  # the request's fault: no retry helps
                raise InvalidRequestError(exc.message, param="response_format") from exc
            if exc.error_type == REQUEST_TOO_LARGE_ERROR_TYPE:  # the same, for good
                raise RequestTooLargeError(exc.message) from exc
            raise UpstreamError(
                f"{entry.instance_id} refused the request: {exc.detail}", (entry.instance_id,)
            ) from exc
        streams = len(plan.decode_sources)
        merged = _merged(plan, client, queue, merger, streams, deadline, listeners, p_reported)
        async for event in merged:
            yield event
    finally:
        _buffers.discard(queue)
        awaits_p = merger.finished and plan.ships_kv_over_wan and not p_reported.is_set()
        stopping = readers[:-1] if awaits_p else readers
        if merger.finished:  # their streams' ends are on the way: let them arrive
            _spawn(_finish_reading(stopping))
        else:
            for reader in stopping:
                reader.stop()
        if not merger.finished:
            _spawn(_cancel_everywhere(plan, client, started))
        if awaits_p:
            _spawn(_p_report(plan, queue, deadline, listeners, readers[-1], on_reports_over))
        elif on_reports_over is not None:
            on_reports_over()


async def _merged(
    plan: PipelinePlan,
    client: WorkerClient,
    queue: asyncio.Queue[TokenEvent | _StreamEnd],
    merger: TokenStreamMerger,
    open_streams: int,
    deadline: float,
    listeners: tuple[LinkFaultListener | None, KVShippedListener | None],
    p_reported: asyncio.Event,
) -> AsyncIterator[TokenEvent]:
    """Yields released tokens; the deadline is checked per wait, never across a yield.
    ``open_streams`` counts the decode sources only: P's report stream may end any time.

    An MD whose KV stopped coming blames P, but cannot tell P's death from a cut line.
    While P's stream is open P is alive, and it reports the line within its own
    timeout; so a failure that blames P waits for P's stream (its report or its end)
    before it is raised, rather than have the retry leave out a healthy P. A stream P
    closed (not broken) clears the blame too: P was alive to the end."""
    p = plan.prefill.instance_id if plan.prefill is not None and plan.ships_kv_over_wan else None
    p_open = p is not None
    on_link_fault, on_kv_shipped = listeners
    while not merger.finished:
        if open_streams == 0 and not (p_open and p in merger.failed):
            raise UpstreamError(
                f"request {plan.request_id}: every worker stream ended after "
                f"{merger.next_seq} tokens without a finish; errors: {merger.errors or 'none'}",
                merger.failed,
            )
        item = queue.get_nowait() if queue.qsize() else await _next(plan, queue, merger, deadline)
        if item.source == p:
            # P's reports: a transfer to MD that failed or was imported, and its stream's end.
            p_reported.set()
            if isinstance(item, _StreamEnd):
                p_open = False
                if item.broken is None:  # P finished its part alive: the line failed, not P
                    _clear_blame(merger, p)
            elif item.kv_shipped is not None:
                if on_kv_shipped is not None:
                    on_kv_shipped(item.kv_shipped)
            elif item.link_fault is not None:
                if on_link_fault is not None:
                    on_link_fault(item)
                await _kv_cannot_cross(plan, client, item, merger)
            continue
        if isinstance(item, _StreamEnd):
            open_streams -= 1
            if item.broken is not None:
                merger.errors.setdefault(item.source, item.broken)
                await _route_around(plan, client, item.source, merger)
            continue
        if item.error is not None and item.error_type is not None:
            raise _request_failure(plan, item)
        for event in merger.accept(item):
            yield event
        if item.error is not None and not merger.finished:
            await _route_around(plan, client, item.source, merger)


async def _next(
    plan: PipelinePlan,
    queue: asyncio.Queue[TokenEvent | _StreamEnd],
    merger: TokenStreamMerger,
    deadline: float,
) -> TokenEvent | _StreamEnd:
    """The next event, waited for until the request's deadline. Only an empty queue is
    waited on: a deadline scope is a timer on the loop's heap, made and cancelled, and
    an event already queued is taken without one (as the scope itself would, unsuspended,
    however late). A scope, not ``wait_for``: that wraps every wait in a task of its own
    (docs/router-scale.md)."""
    try:
        async with asyncio.timeout_at(deadline):
            return await queue.get()
    except TimeoutError:
        raise UpstreamError(
            f"request {plan.request_id} did not finish in time ({merger.next_seq} tokens)"
        ) from None


async def _p_report(
    plan: PipelinePlan,
    queue: asyncio.Queue[TokenEvent | _StreamEnd],
    deadline: float,
    listeners: tuple[LinkFaultListener | None, KVShippedListener | None],
    reader: StoppableTask,
    on_reports_over: ReportsOverListener | None,
) -> None:
    """The client has its answer (a relay finished it) while P's KV for MD is still on
    the line: wait for P's report on it (imported, or failed), or its stream's end, or
    the request's deadline, and pass it on."""
    assert plan.prefill is not None  # only plans that ship KV over the WAN wait
    p = plan.prefill.instance_id
    on_link_fault, on_kv_shipped = listeners
    loop = asyncio.get_running_loop()
    try:
        while True:
            item = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
            if item.source != p:
                continue
            if isinstance(item, _StreamEnd):
                return
            if item.kv_shipped is not None:
                if on_kv_shipped is not None:
                    on_kv_shipped(item.kv_shipped)
                return
            if item.link_fault is not None:
                if on_link_fault is not None:
                    on_link_fault(item)
                return
    except TimeoutError:
        return
    finally:
        reader.stop()
        if on_reports_over is not None:
            on_reports_over()


def _request_failure(plan: PipelinePlan, event: TokenEvent) -> RouterError:
    """A source's report that the request's own work failed (``TokenEvent.error_type``):
    any other instance would fail it alike, so it ends here, blaming none (no retry, no
    suspect instance): the client's 400 where its grammar failed, else a 500."""
    if event.error_type == GRAMMAR_ERROR_TYPE:
        guided = plan.sampling.guided
        param = "tools" if guided is not None and guided.kind == "tool_calls" else "response_format"
        return InvalidRequestError(event.error or "its grammar failed", param=param)
    return RouterError(f"the request failed on {event.source}: {event.error}")


def _clear_blame(merger: TokenStreamMerger, instance_id: str | None) -> None:
    """Blame the sources themselves, not ``instance_id``, for the errors that named it."""
    for source, culprit in list(merger.culprits.items()):
        if culprit == instance_id:
            del merger.culprits[source]


async def _kv_cannot_cross(
    plan: PipelinePlan, client: WorkerClient, report: TokenEvent, merger: TokenStreamMerger
) -> None:
    """P says MD will not get the KV: the relay carries the request, or, with none on the
    route, the request fails now, blaming MD (``report.culprit``) so the retry avoids it.
    Nothing changes once MD streams: it had the KV (P lost only the acknowledgement)."""
    assert plan.main is not None  # P reports only transfers to MD
    md = plan.main.instance_id
    if any(e.source == md for e in merger.emitted):
        return
    merger.errors.setdefault(md, report.error or "")
    _clear_blame(merger, report.source)  # MD blamed P for KV that stopped: it was the line
    if plan.pipeline == Pipeline.P_RLD_MD:
        await _route_around(plan, client, md, merger)
        return
    raise UpstreamError(f"request {plan.request_id}: {report.error}", merger.failed)


async def _route_around(
    plan: PipelinePlan, client: WorkerClient, failed: str, merger: TokenStreamMerger
) -> None:
    """A decode-side source failed: ask the other one to carry the request."""
    if plan.pipeline != Pipeline.P_RLD_MD or plan.relay is None or plan.main is None:
        return
    log.warning(
        "request %s: %s failed (%s); routing around it",
        plan.request_id,
        failed,
        merger.errors.get(failed),
    )
    survivor = plan.main if failed == plan.relay.instance_id else plan.relay
    tracing.event(
        "pdd.failover",
        {"pdd.failed": failed, "pdd.failover.to": survivor.instance_id,
         "pdd.emitted_tokens": len(merger.token_ids), "pdd.error": merger.errors.get(failed, "")},
    )  # fmt: skip
    with contextlib.suppress(WorkerCallError):
        if failed == plan.relay.instance_id:
            await client.handoff(plan.main.http_url, plan.request_id, merger.token_ids)
        elif failed == plan.main.instance_id:
            await client.takeover(plan.relay.http_url, plan.request_id)


async def _read(
    client: WorkerClient,
    endpoint: Endpoint,
    request_id: str,
    queue: asyncio.Queue[TokenEvent | _StreamEnd],
) -> None:
    broken: str | None = None
    try:
        async for event in client.stream(endpoint.http_url, request_id):
            await queue.put(event)  # waits while the client is this far behind
    except WorkerCallError as exc:
        broken = exc.detail
    await queue.put(_StreamEnd(endpoint.instance_id, broken))


async def _finish_reading(readers: list[StoppableTask]) -> None:
    """Give the readers of a finished request ``STREAM_END_GRACE_S`` to reach their
    streams' ends on their own, then stop whichever has not (a worker that keeps a
    finished stream open costs that connection, as before)."""
    if readers:  # asyncio.wait refuses an empty set
        await asyncio.wait([r.task for r in readers], timeout=STREAM_END_GRACE_S)  # cancels none
    for reader in readers:
        reader.stop()


async def _cancel_everywhere(
    plan: PipelinePlan, client: WorkerClient, started: asyncio.Future[None]
) -> None:
    """Cancel the request on every instance of its plan, once its start has settled (a
    cancel that overtook the plan would find nothing to stop at the entry; the relay
    and MD, which P's ``prepare`` may reach after their cancel, remember it instead)."""
    with contextlib.suppress(Exception):
        await started
    endpoints = [e for e in (plan.prefill, plan.relay, plan.main) if e is not None]
    await asyncio.gather(*(client.cancel(e.http_url, plan.request_id) for e in endpoints))


def _spawn(coro: Coroutine[Any, Any, None]) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
