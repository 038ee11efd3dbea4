"""The relay's per-token path creates no task, nor a timer for an event already read:
its cost per token stays a few calls.

Every token event of every request passes through the relay's merge loop, which waits
for the next event under the request's deadline. ``asyncio.wait_for`` wraps each such
wait in a task of its own (and a timer): on a 16-token request, 16 tasks made, scheduled
and torn down in the router's hottest loop (docs/router-scale.md). The loop now waits
under one deadline scope per wait, with no task, and takes an event the readers already
queued without a scope (a timer on the loop's heap, made and cancelled) since it does
not wait for it. Here a mono request's stream is read from an in-process worker, which
queues every event before the loop reads the first, and the tasks and timers the
request makes are counted: as many for 64 tokens as for 4.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from pdd.common.vocabulary import Pipeline
from pdd.common.wire import Endpoint, PipelinePlan, SamplingSpec, TokenEvent
from pdd.router.stream_relay import relay_tokens
from pdd.router.worker_client import WorkerClient

pytestmark = pytest.mark.unit

MAIN = Endpoint(instance_id="m", http_url="http://m:1", fast_addr="m:2", wan_addr="m:3")


def _worker(tokens: int) -> httpx.MockTransport:
    """Takes the plan (202), then streams ``tokens`` token events, the last finished."""

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(202)

        async def body() -> AsyncIterator[bytes]:
            for seq in range(tokens):
                event = TokenEvent(
                    request_id="r", seq=seq, token_id=seq, source="m", finished=seq == tokens - 1
                )
                yield event.model_dump_json().encode() + b"\n"

        return httpx.Response(200, content=body())

    return httpx.MockTransport(handle)


async def _tasks_made(tokens: int) -> int:
    """Tasks created while one ``tokens``-token request is relayed to its end."""
    loop = asyncio.get_running_loop()
    made = 0

    def counting(loop: asyncio.AbstractEventLoop, coro, **kw):  # type: ignore[no-untyped-def]
        nonlocal made
        made += 1
        return asyncio.Task(coro, loop=loop, **kw)

    loop.set_task_factory(counting)
    try:
        await _relay(tokens)
    finally:
        loop.set_task_factory(None)
    return made


async def _timers_made(tokens: int) -> int:
    """Timers scheduled while one ``tokens``-token request is relayed to its end."""
    loop = asyncio.get_running_loop()
    made = 0
    call_at = loop.call_at

    def counting(when, callback, *args, **kw):  # type: ignore[no-untyped-def]
        nonlocal made
        made += 1
        return call_at(when, callback, *args, **kw)

    loop.call_at = counting  # type: ignore[method-assign]
    try:
        await _relay(tokens)
    finally:
        del loop.call_at
    return made


async def _relay(tokens: int) -> None:
    """Relays one mono ``tokens``-token request from an in-process worker to its end."""

    plan = PipelinePlan(
        request_id="r", prompt_ids=[1, 2, 3], sampling=SamplingSpec(max_tokens=tokens),
        pipeline=Pipeline.MONO, main=MAIN,
    )  # fmt: skip
    client = WorkerClient("s", transport=_worker(tokens))
    try:
        got = [e.token_id async for e in relay_tokens(plan, client, timeout_s=60.0)]
    finally:
        await client.aclose()
    assert got == list(range(tokens))


async def test_the_tasks_a_request_makes_do_not_grow_with_its_tokens() -> None:
    assert await _tasks_made(64) == await _tasks_made(4)


async def test_the_timers_a_request_makes_do_not_grow_with_its_queued_tokens() -> None:
    # One either way: the request's end waits for its reader's stream end (a timer) or
    # finds it there already, as the reader got ahead or not (64 against 5 before).
    assert await _timers_made(64) <= await _timers_made(4) + 1
