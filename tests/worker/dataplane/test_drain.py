"""Draining a worker (what SIGTERM starts): out of the router's choice at once, nothing lost.

In-process on a virtual clock. The WAN path to MD is held closed until every relay has
streamed well past the catch-up threshold; then the relay starts draining, and only then
is the path released, so every handoff happens while the relay drains.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdd.common.vocabulary import Role
from pdd.common.wire import TokenEvent
from pdd.router.config import WorkerRef
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig
from pdd.router.registry import InstanceRegistry
from pdd.testing.waiting import until

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

THRESHOLD = 64  # the plan's default catch-up threshold
MAX_TOKENS = 120


async def test_a_draining_relay_leaves_the_routers_choice_and_hands_everything_over(vdp):
    prompts = vdp.prompts(4, seed=5, lo=60, hi=100)
    expected = await vdp.reference(prompts, MAX_TOKENS, "drain")
    plans = [  # the plans ask for catch-up; a draining relay hands over in one shot
        vdp.cluster.plan(
            f"drain-{i}", p, "P-RLD-MD", vdp.sampling(i, MAX_TOKENS), handoff="catch-up"
        )
        for i, p in enumerate(prompts)
    ]
    relay = vdp.cluster["rld"]
    client = vdp.cluster.client()
    block_size = relay.instance.runner.engine.config.block_size
    registry = InstanceRegistry(
        (WorkerRef(role=Role.RELAY, http_url=relay.url, instance_id="rld"),),
        client,
        PrefixIndex(PrefixIndexConfig(block_size=block_size)),
        interval_s=1.0,
    )
    await registry.poll_once()
    assert [i.instance_id for i in registry.ready(Role.RELAY)] == ["rld"]

    path = vdp.cluster.wan_path("md")
    delta = vdp.counters("rld", "md")
    streamed: dict[str, int] = {}
    draining: list[asyncio.Task[bool]] = []

    def drain_then_release_once_every_relay_is_past_the_threshold(event: TokenEvent) -> None:
        streamed[event.request_id] = event.seq
        if not draining and len(streamed) == len(plans) and min(streamed.values()) > THRESHOLD:
            draining.append(asyncio.ensure_future(relay.instance.drain(grace_s=600.0)))
            path.resume()

    path.pause()
    results = await vdp.run_all(
        plans, on_token=drain_then_release_once_every_relay_is_past_the_threshold
    )
    assert draining, "the relays never got past the threshold: the scenario did not run"
    assert relay.role.draining

    assert [r.token_ids for r in results] == expected  # nothing lost, nothing repeated
    assert all(r.duplicates == 0 and not r.errors for r in results)
    assert all(r.sources[-1] == "md" for r in results)  # every request ended on MD
    assert delta("rld", "pdd_worker_handoffs", 'mode="one-shot"') == len(plans)
    assert delta("rld", "pdd_worker_handoffs", 'mode="catch-up"') == 0

    assert (await client.load(relay.url)).draining
    async with httpx.AsyncClient(transport=vdp.cluster.http) as probe:
        ready = await probe.get(f"{relay.url}/ready")  # what a readiness probe sees
    assert ready.status_code == 503
    await registry.poll_once()
    assert registry.ready(Role.RELAY) == []
    assert "draining" in (registry.all()[0].problem or "")
    assert await draining[0]  # every request with state on the relay ended within the grace
    await client.aclose()
    await vdp.assert_quiescent()


async def test_a_draining_instance_serves_what_is_still_sent_during_the_notice(vdp):
    """Routers and the Service learn of a drain only on their next poll: an idle MD told to
    stop must not exit under a request sent to it meanwhile. It serves it, token-exact, and
    exits only once the notice has passed and nothing is live."""
    prompts = vdp.prompts(1, seed=9)
    expected = await vdp.reference(prompts, 40, "notice")
    main = vdp.cluster["md"]
    loop = asyncio.get_running_loop()
    started = loop.time()
    drained_at: list[float] = []

    async def drain() -> bool:
        ok = await main.instance.drain(grace_s=600.0, notice_s=5.0)
        drained_at.append(loop.time())
        return ok

    draining = asyncio.ensure_future(drain())
    await until(lambda: main.role.draining, "the drain to begin")
    assert not main.role.live and not draining.done()  # idle, yet it stays
    plan = vdp.cluster.plan("notice-0", prompts[0], "P-MD", vdp.sampling(0, 40))
    [result] = await vdp.run_all([plan])
    assert result.token_ids == expected[0] and not result.errors
    assert result.sources[-1] == "md"
    assert await draining
    assert drained_at[0] >= started + 5.0  # not before the notice passed
    await vdp.assert_quiescent()
