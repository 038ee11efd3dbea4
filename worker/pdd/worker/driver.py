"""A minimal client that runs one plan against the workers directly (until the router exists).

It does what the router's stream layer will do: open the token stream of
every decode-side instance, start the plan at its entry point, merge the
streams by position (``TokenStreamMerger``), and route around a dead peer:

* the relay's stream breaks before the handoff -> POST the token IDs the
  client already has to the main decode's ``/handoff`` (it continues after them);
* the main decode's stream breaks or reports an error -> POST ``/takeover`` to
  the relay (it streams everything and finishes the request).

Torch-free: it only speaks HTTP and the wire schemas.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from pdd.common.token_stream import TokenStreamMerger
from pdd.common.wire import Endpoint, PipelinePlan, TokenEvent


class PipelineError(RuntimeError):
    """The request ended without a finished stream; the message lists what each source said."""


@dataclass
class RunResult:
    request_id: str
    events: list[TokenEvent]
    duplicates: int
    errors: dict[str, str] = field(default_factory=dict)
    first_token_s: float | None = None  # seconds from start to the first released token
    max_gap_s: float = 0.0  # largest pause between consecutive released tokens

    @property
    def token_ids(self) -> list[int]:
        return [e.token_id for e in self.events]  # type: ignore[misc]

    @property
    def sources(self) -> list[str]:
        return [e.source for e in self.events]


@dataclass(frozen=True)
class _StreamEnd:
    source: str
    broken: str | None  # None: closed cleanly; else why it broke


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def run_plan(
    plan: PipelinePlan,
    client: httpx.AsyncClient,
    secret: str,
    timeout_s: float = 120.0,
    on_token: Callable[[TokenEvent], None] | None = None,
) -> RunResult:
    """Run ``plan`` to completion and return the merged stream; raises ``PipelineError``.

    ``on_token`` sees each released token as the client would (tests inject faults there).
    """
    queue: asyncio.Queue[TokenEvent | _StreamEnd] = asyncio.Queue()
    sources = {ep.instance_id: ep for ep in plan.decode_sources}
    readers = [
        asyncio.create_task(_read_stream(client, ep, plan.request_id, secret, queue))
        for ep in sources.values()
    ]
    try:
        entry = plan.main if plan.pipeline == "mono" else plan.prefill
        assert entry is not None  # guaranteed by PipelinePlan's validator
        resp = await client.post(
            f"{entry.http_url}/v1/pdd/requests",
            content=plan.model_dump_json(),
            headers=_auth(secret),
        )
        if resp.status_code != 202:
            raise PipelineError(f"{entry.instance_id} refused the plan: {resp.text}")
        return await asyncio.wait_for(
            _merge(plan, client, secret, queue, len(readers), on_token), timeout_s
        )
    except TimeoutError:
        raise PipelineError(f"request {plan.request_id} did not finish in {timeout_s}s") from None
    finally:
        for task in readers:
            task.cancel()
        for task in readers:
            with contextlib.suppress(BaseException):
                await task


async def _merge(
    plan: PipelinePlan,
    client: httpx.AsyncClient,
    secret: str,
    queue: asyncio.Queue[TokenEvent | _StreamEnd],
    open_streams: int,
    on_token: Callable[[TokenEvent], None] | None,
) -> RunResult:
    merger = TokenStreamMerger(plan.request_id)
    start = time.monotonic()
    first_s: float | None = None
    last_t, max_gap = start, 0.0
    while not merger.finished:
        if open_streams == 0:
            raise PipelineError(
                f"request {plan.request_id}: every stream ended after {merger.next_seq} tokens "
                f"without a finish; errors: {merger.errors or 'none'}"
            )
        item = await queue.get()
        if isinstance(item, _StreamEnd):
            open_streams -= 1
            if item.broken is not None:
                merger.errors.setdefault(item.source, item.broken)
                await _route_around(plan, client, secret, item.source, merger)
            continue
        for released in merger.accept(item):
            if on_token is not None:
                on_token(released)
            now = time.monotonic()
            first_s = now - start if first_s is None else first_s
            max_gap, last_t = max(max_gap, now - last_t), now
        if item.error is not None and not merger.finished:
            await _route_around(plan, client, secret, item.source, merger)
    return RunResult(
        plan.request_id, merger.emitted, merger.duplicates, merger.errors, first_s, max_gap
    )


async def _route_around(
    plan: PipelinePlan,
    client: httpx.AsyncClient,
    secret: str,
    failed: str,
    merger: TokenStreamMerger,
) -> None:
    """A decode-side source failed: ask the other one to carry the request."""
    if plan.pipeline != "P-RLD-MD" or plan.relay is None or plan.main is None:
        return
    if failed == plan.relay.instance_id:
        url = f"{plan.main.http_url}/v1/pdd/requests/{plan.request_id}/handoff"
        body = {"token_ids": merger.token_ids}
    elif failed == plan.main.instance_id:
        url = f"{plan.relay.http_url}/v1/pdd/requests/{plan.request_id}/takeover"
        body = {}
    else:
        return
    with contextlib.suppress(httpx.HTTPError):
        await client.post(url, json=body, headers=_auth(secret))


async def _read_stream(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    request_id: str,
    secret: str,
    queue: asyncio.Queue[TokenEvent | _StreamEnd],
) -> None:
    url = f"{endpoint.http_url}/v1/pdd/requests/{request_id}/stream"
    broken: str | None = None
    try:
        async with client.stream("GET", url, headers=_auth(secret), timeout=None) as resp:
            if resp.status_code != 200:
                broken = f"stream answered {resp.status_code}"
            else:
                async for line in resp.aiter_lines():
                    if line.strip():
                        queue.put_nowait(TokenEvent.model_validate_json(line))
    except httpx.HTTPError as exc:
        broken = f"stream from {endpoint.instance_id} broke: {exc!r}"
    queue.put_nowait(_StreamEnd(endpoint.instance_id, broken))
