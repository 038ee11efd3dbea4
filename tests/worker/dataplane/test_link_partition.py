"""A cut WAN line, through the router's own code: no request fails, P-MD waits for the line.

The router here is the real one (``RouterRuntime``: registry, policy, dispatcher,
``Generation``'s recovery, link health), reaching in-process workers on a virtual clock
with the workers' default timeouts (30 s transfer, 10 s connect). The line to MD is
cut with the WAN link emulator's partition (new connections refused, those open reset
after the grace period), so every step happens at a fixed loop time on any machine.
The requests are greedy and compared with the colocated ``mono`` instance.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager

import pytest

from pdd.common.vocabulary import Pipeline, Role
from pdd.local.probes import flatten
from pdd.router.generation import Generation
from pdd.router.link_health import LinkCondition
from pdd.router.openai_protocol import CompletionRequest
from pdd.router.runtime import RouterRuntime
from pdd.router.serving_base import OpenAIServing
from pdd.testing.waiting import until

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

MAX_TOKENS = 40
TRICKLE_GBPS = 1e-5  # the KV stays in flight for minutes


def router(vdp) -> AbstractAsyncContextManager[RouterRuntime]:
    """A router over P, RLD and MD; it polls once at start (no poll decides anything)."""
    workers = ((Role.PREFILL, "p"), (Role.RELAY, "rld"), (Role.MAIN, "md"))
    return vdp.cluster.router(workers)


async def complete(runtime: RouterRuntime, prompt: list[int]) -> Generation:
    """One greedy completion through the router's serving layer, read to the end."""
    serving = OpenAIServing(runtime)
    request = CompletionRequest(
        model=runtime.config.served_name,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        ignore_eos=True,
    )
    generation = await serving.start(prompt, request, MAX_TOKENS, "prompt")
    async for _ in generation.deltas():
        pass
    return generation


def metric(runtime: RouterRuntime, key: str) -> float:
    return flatten(runtime.metrics.render().decode()).get(key, 0.0)


def redispatches(runtime: RouterRuntime) -> float:
    return metric(runtime, 'pdd_router_recoveries_total{kind="redispatch"}')


async def greedy_reference(vdp, prompts: list[list[int]], tag: str) -> list[list[int]]:
    return [(await vdp.reference([p], MAX_TOKENS, f"{tag}-{i}"))[0] for i, p in enumerate(prompts)]


async def test_a_cut_line_is_avoided_until_a_transfer_crosses_it_again(
    vdp_default_timeouts,
) -> None:
    vdp = vdp_default_timeouts
    prompts = vdp.prompts(4, seed=61, lo=90, hi=91)
    expected = await greedy_reference(vdp, prompts, "lp")
    line = vdp.cluster["md"].link
    connect_s = vdp.cluster["p"].instance.settings.transport.connect_timeout_s
    loop = asyncio.get_running_loop()
    async with router(vdp) as rt:
        healthy = await complete(rt, prompts[0])
        assert healthy.route.pipeline == Pipeline.P_MD and healthy.token_ids == expected[0]

        line.partition(True)
        start = loop.time()
        caught = await complete(rt, prompts[1])  # routed P-MD: P cannot reach MD
        # P's report, not MD's 30 s transfer timeout, sent it through the relay.
        assert loop.time() - start < connect_s
        assert caught.token_ids == expected[1] and redispatches(rt) == 1
        assert caught.route.pipeline == Pipeline.P_RLD  # MD left out: the relay finished it
        assert rt.link_health.condition is LinkCondition.SUSPECTED_CUT

        during = await complete(rt, prompts[2])  # a relay on the route: nothing to recover
        assert during.route.pipeline == Pipeline.P_RLD_MD
        assert during.route.reason_code == "link_doubted"
        assert during.token_ids == expected[2] and redispatches(rt) == 1
        assert rt.link_health.condition is LinkCondition.SUSPECTED_CUT

        line.partition(False)
        probe = await complete(rt, prompts[3])  # still relayed: its KV crossing is the proof
        assert probe.route.pipeline == Pipeline.P_RLD_MD and probe.token_ids == expected[3]
        assert rt.link_health.condition is LinkCondition.HEALTHY

        again = await complete(rt, prompts[0])
        assert again.route.pipeline == Pipeline.P_MD and again.token_ids == expected[0]
        for to in ("suspected_cut", "healthy"):
            assert metric(rt, f'pdd_router_link_transitions_total{{link="wan",to="{to}"}}') == 1
        assert metric(rt, 'pdd_router_link_state{link="wan",state="healthy"}') == 1
    await vdp.assert_quiescent()


async def test_a_p_md_request_caught_mid_transfer_is_served_through_the_relay(
    vdp_default_timeouts,
) -> None:
    """The line is cut while a P-MD request's KV is on it: P's transfer is reset at the
    end of the grace period and P says so; the router re-dispatches through the relay
    and the client gets mono's tokens, well before MD's transfer timeout."""
    vdp = vdp_default_timeouts
    prompt = vdp.prompts(1, seed=62, lo=90, hi=91)[0]
    [expected] = await greedy_reference(vdp, [prompt], "lp-mid")
    line = vdp.cluster["md"].link
    loop = asyncio.get_running_loop()
    async with router(vdp) as rt:
        line.set_rate(TRICKLE_GBPS)  # the router's policy still counts on the declared rate
        sent = vdp.counters("p")
        request = asyncio.ensure_future(complete(rt, prompt))
        await until(lambda: sent("p", "pdd_worker_wan_kv_bytes") > 0, "P's KV on the line")
        line.partition(True)
        cut_at = loop.time()
        caught = await request
        assert loop.time() - cut_at < vdp.cluster["p"].instance.settings.transfer_timeout_s
        assert caught.route.pipeline == Pipeline.P_RLD and caught.token_ids == expected
        assert redispatches(rt) == 1
        assert rt.link_health.condition is LinkCondition.SUSPECTED_CUT
        line.partition(False)
    await vdp.assert_quiescent()


async def test_a_p_md_transfer_that_stops_moving_is_served_through_the_relay(
    vdp_default_timeouts,
) -> None:
    """The line's goodput collapses under a P-MD request's KV (no reset): MD's read times
    out first and blames P, which it cannot tell from a dead P; P, alive, reports the
    stalled transfer a moment later. The router waits for P's word, so the retry leaves
    out MD, not the only P, and the relay serves the request; the line is degraded."""
    vdp = vdp_default_timeouts
    prompt = vdp.prompts(1, seed=63, lo=90, hi=91)[0]
    [expected] = await greedy_reference(vdp, [prompt], "lp-stall")
    line = vdp.cluster["md"].link
    async with router(vdp) as rt:
        line.set_rate(TRICKLE_GBPS)  # the router's policy still counts on the declared rate
        stalled = await complete(rt, prompt)
        assert stalled.route.pipeline == Pipeline.P_RLD and stalled.token_ids == expected
        assert redispatches(rt) == 1
        assert rt.link_health.condition is LinkCondition.DEGRADED
        line.set_rate(vdp.cluster.link_spec.gbps)
    await vdp.assert_quiescent()
