"""A request waiting in P's queue takes no slot of its main decode (issue 59, run 6).

In ``pdd bench --autoscale`` run 6 (docs/planner.md) P's queue grew to 27 s and the
router answered 134 requests 429 "every main-decode instance is at capacity": it counted
each request against its MD from dispatch, while the request still waited for P, so P's
backlog reached the client as MD refusals. MD learns of a request only when P starts
shipping its KV; until the request's first token it runs nothing of it. Such a request now
weighs in MD's choice (the least loaded MD still gets the next one) but not in its
saturation; from its first token it counts in full, so an MD whose batch is truly full
still answers 429. A P backlog is refused, where at all, by P's own capacity.

The workers are scripted (``pdd.testing.scripted_worker``): the router's own registry polls
them; the streams are what ``relay_tokens`` yields for a plan, held open by the test.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import pytest

from pdd.common.vocabulary import Role
from pdd.common.wire import LoadReport, PipelinePlan, SamplingSpec, TokenEvent
from pdd.router import generation
from pdd.router.dispatcher import Attempt
from pdd.router.errors import SaturatedError
from pdd.router.generation import Generation
from pdd.router.runtime import RouterRuntime
from pdd.testing.scripted_worker import ScriptedWorkers

pytestmark = pytest.mark.unit

TOPOLOGY = {"p0": Role.PREFILL, "p1": Role.PREFILL, "rld": Role.RELAY, "md": Role.MAIN}
P_CAPACITY, MD_CAPACITY = 8, 2
PROMPT = [104, 105, 33]


@dataclass
class Workers(ScriptedWorkers):
    """Idle workers (nothing running or waiting) with the capacities named here."""

    capacity: Mapping[str, int] = field(default_factory=dict)

    def load(self, name: str) -> LoadReport:
        return super().load(name).model_copy(update={"capacity": self.capacity[name]})


@pytest.fixture
async def runtime() -> AsyncIterator[RouterRuntime]:
    capacity = {"p0": P_CAPACITY, "p1": P_CAPACITY, "rld": P_CAPACITY, "md": MD_CAPACITY}
    runtime = Workers(TOPOLOGY, capacity=capacity).router()
    await runtime.registry.poll_once()
    assert runtime.ready()
    try:
        yield runtime
    finally:
        await runtime.close()


async def dispatch(runtime: RouterRuntime, i: int) -> Attempt:
    """One request routed (its lease held), as the server routes it."""
    sampling = SamplingSpec(max_tokens=4)
    return await runtime.dispatcher.attempt([*PROMPT, i], sampling, request_id=f"r{i}")


async def test_requests_queued_at_p_are_routed_past_mds_capacity(runtime) -> None:
    """Twice MD's capacity, all still waiting for P (no token yet): every one is routed,
    to the one MD, and only P's capacity bounds them."""
    held = [await dispatch(runtime, i) for i in range(2 * MD_CAPACITY + 1)]
    assert {a.route.main.instance_id for a in held if a.route.main} == {"md"}
    more = [await dispatch(runtime, i) for i in range(len(held), 2 * P_CAPACITY)]
    with pytest.raises(SaturatedError, match="every prefill instance is at capacity"):
        await dispatch(runtime, 2 * P_CAPACITY)
    for a in held + more:
        a.lease.release_all()


class Streams:
    """Each plan's stream: one token from MD, then held open until ``end`` is set."""

    def __init__(self) -> None:
        self.end = asyncio.Event()
        self.plans: list[PipelinePlan] = []

    async def relay_tokens(
        self, plan: PipelinePlan, *_: object, **__: object
    ) -> AsyncIterator[TokenEvent]:
        assert plan.main is not None
        self.plans.append(plan)
        source = plan.main.instance_id
        yield TokenEvent(request_id=plan.request_id, seq=0, token_id=97, source=source)
        await self.end.wait()
        yield TokenEvent(
            request_id=plan.request_id, seq=1, token_id=98, source=source,
            finished=True, finish_reason="stop",
        )  # fmt: skip


async def test_from_its_first_token_a_request_counts_in_full_against_md(
    runtime, monkeypatch
) -> None:
    """MD's batch truly full (each request streaming from it) is still a 429 naming MD,
    and the next request is routed once one of them ends."""
    streams = Streams()
    monkeypatch.setattr(generation, "relay_tokens", streams.relay_tokens)
    gens = [Generation(runtime, await dispatch(runtime, i), [], 0.0) for i in range(MD_CAPACITY)]
    readers = [gen.deltas() for gen in gens]
    for reader in readers:
        await anext(reader)  # the first token: the request is at MD now
    with pytest.raises(SaturatedError, match="every main-decode instance is at capacity"):
        await dispatch(runtime, MD_CAPACITY)
    streams.end.set()
    for reader in readers:
        async for _ in reader:
            pass
    (await dispatch(runtime, MD_CAPACITY + 1)).lease.release_all()
