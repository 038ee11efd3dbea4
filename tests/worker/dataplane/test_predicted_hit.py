"""P ships MD's miss from the router's predicted hit, on a channel it keeps warm.

In-process on a virtual clock. Whatever the prediction (right, too high: MD lacks a
gap below it, too low: MD already holds part of what is sent), MD ends up with the
prompt's exact KV, so the client gets mono's tokens; only the bytes on the line differ.
And sequential requests to one MD reuse P's channels instead of opening new ones.
"""

from __future__ import annotations

import asyncio

import pytest

from pdd.common.vocabulary import Pipeline, Role
from pdd.router.errors import UpstreamError
from pdd.router.generation import Generation
from pdd.router.openai_protocol import CompletionRequest
from pdd.router.runtime import RouterRuntime
from pdd.router.serving_base import OpenAIServing

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

MAX_TOKENS = 24
#: One way across the line to MD: long enough that P's prefill is done, and its KV on the
#: way, before MD's answer is back (as across a real WAN), so the prediction is used.
SLOW_LINE_S = 0.2


async def warm_md(vdp, prompt: list[int], tag: str) -> None:
    """Leave the whole prompt in MD's radix cache (a P-MD request MD finishes)."""
    plan = vdp.cluster.plan(tag, prompt, "P-MD", vdp.sampling(0, MAX_TOKENS), main_hit_tokens=0)
    await vdp.run_all([plan])


async def test_a_right_prediction_sends_exactly_the_miss(vdp) -> None:
    prompt = vdp.prompts(1, seed=81, lo=90, hi=91)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "ph-right")
    delta = vdp.counters("p", "md")
    plan = vdp.cluster.plan(
        "ph-right-0", prompt, "P-MD", vdp.sampling(0, MAX_TOKENS), main_hit_tokens=0
    )
    [result] = await vdp.run_all([plan])
    assert result.token_ids == expected[0] and result.sources == ["md"] * MAX_TOKENS
    assert delta("p", "pdd_worker_wan_kv_bytes") == len(prompt) * vdp.kv_bytes_per_token
    assert delta("md", "pdd_worker_prefix_hit_tokens") == 0
    await vdp.assert_quiescent()


async def test_md_holding_less_than_predicted_gets_the_gap(vdp) -> None:
    """The router believed MD held the whole prompt; it holds nothing (cold): P sends
    nothing from the prediction, then the gap [0, n) once MD's answer says so."""
    prompt = vdp.prompts(1, seed=82, lo=90, hi=91)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "ph-high")
    vdp.cluster.wan_path("md").delay_s = SLOW_LINE_S
    delta = vdp.counters("p", "md")
    plan = vdp.cluster.plan(
        "ph-high-0", prompt, "P-MD", vdp.sampling(0, MAX_TOKENS), main_hit_tokens=len(prompt) - 1
    )
    [result] = await vdp.run_all([plan])
    assert result.token_ids == expected[0] and result.sources == ["md"] * MAX_TOKENS
    assert delta("p", "pdd_worker_wan_kv_bytes") == len(prompt) * vdp.kv_bytes_per_token
    assert delta("p", "pdd_worker_transfer_failures") == 0
    await vdp.assert_quiescent()


async def test_md_holding_more_than_predicted_skips_what_it_holds(vdp) -> None:
    """MD holds most of the prompt, the prediction says nothing: MD imports none of the
    overlap (its cached blocks are never overwritten) and streams mono's tokens."""
    prompt = vdp.prompts(1, seed=83, lo=90, hi=91)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "ph-low")
    await warm_md(vdp, prompt, "ph-low-warm")
    vdp.cluster.wan_path("md").delay_s = SLOW_LINE_S
    delta = vdp.counters("p", "md")
    plan = vdp.cluster.plan(
        "ph-low-0", prompt, "P-MD", vdp.sampling(0, MAX_TOKENS), main_hit_tokens=0
    )
    [result] = await vdp.run_all([plan])
    hit = result.events[0].md_hit_tokens
    assert result.token_ids == expected[0] and hit is not None and hit > 0
    assert delta("md", "pdd_worker_prefix_hit_tokens") == hit
    # P sent it all before MD's answer came back (the line's delay), MD kept its own.
    assert delta("p", "pdd_worker_wan_kv_bytes") == len(prompt) * vdp.kv_bytes_per_token
    await vdp.assert_quiescent()


async def test_sequential_requests_reuse_ps_channels_to_md(vdp) -> None:
    prompts = vdp.prompts(4, seed=84, lo=60, hi=61)
    expected = await vdp.reference(prompts, MAX_TOKENS, "ph-pool")
    results = []
    for i, prompt in enumerate(prompts):
        if i == 1:
            opened = vdp.channels_accepted("md")  # the first request's, and a spare
        plan = vdp.cluster.plan(
            f"ph-pool-{i}", prompt, "P-MD", vdp.sampling(i, MAX_TOKENS), main_hit_tokens=0
        )
        results += await vdp.run_all([plan])
    assert [r.token_ids for r in results] == expected
    assert vdp.channels_accepted("md") == opened
    assert vdp.cluster["p"].role.channel_pool.idle("md") >= 1
    await vdp.assert_quiescent()


async def first_token_after(vdp, plan) -> tuple[float, list[int]]:
    """Seconds of loop time from the plan's start to the client's first token, and the
    request's tokens."""
    loop = asyncio.get_running_loop()
    start, firsts = loop.time(), []

    def on_token(event) -> None:
        if event.is_token:
            firsts.append(loop.time())

    [run] = await vdp.run_all([plan], on_token=on_token)
    return firsts[0] - start, run.token_ids


async def test_md_named_ahead_spares_the_first_request_the_connect(vdp) -> None:
    """The router names MD to P before any request there (``PUT /v1/pdd/wan-peers``): P
    opens a channel across the line at once, so the first request's KV leaves on it
    instead of after a connect and the handshake's round trips. Against the same kind of
    request once P keeps no channel, its first token comes a round trip sooner."""
    prompts = vdp.prompts(2, seed=86, lo=60, hi=61)
    expected = await vdp.reference(prompts, MAX_TOKENS, "ph-named")
    vdp.cluster.wan_path("md").delay_s = SLOW_LINE_S
    p, mds = vdp.cluster["p"].role, [vdp.cluster["md"].endpoint]
    client = vdp.cluster.client()  # the router's call, through P's control API
    try:
        await client.warm_wan_peers(vdp.cluster["p"].url, mds)
        await client.warm_wan_peers(vdp.cluster["md"].url, mds)  # not P: nothing to open
    finally:
        await client.aclose()
    assert p.channel_pool.warming("md") == 1  # the route started it before answering
    await asyncio.gather(*p.warm_wan_peers(mds))  # the route's spare, not a new one
    assert p.channel_pool.idle("md") == 1 and vdp.channels_accepted("md") == 1

    def plan(i: int):
        return vdp.cluster.plan(
            f"ph-named-{i}", prompts[i], "P-MD", vdp.sampling(i, MAX_TOKENS), main_hit_tokens=0
        )

    named, named_tokens = await first_token_after(vdp, plan(0))
    for channel in p.channel_pool._idle.pop("md"):  # P forgets its channels: cold again
        await channel.close()
    cold, cold_tokens = await first_token_after(vdp, plan(1))
    assert [named_tokens, cold_tokens] == expected
    assert cold - named >= 2 * SLOW_LINE_S
    p.warm_wan_peers(mds)  # a spare is kept: nothing more opens
    assert p.channel_pool.warming("md") == 0 and p.channel_pool.idle("md") >= 1
    await vdp.assert_quiescent()


async def test_a_cut_line_drops_the_kept_channels_and_p_reconnects_after(vdp) -> None:
    """A kept channel is no shortcut past a cut: the request still fails at once naming
    MD; once the line is back, P opens new channels and P-MD serves again."""
    prompts = vdp.prompts(3, seed=85, lo=60, hi=61)
    expected = await vdp.reference(prompts, MAX_TOKENS, "ph-cut")

    def plan(i: int):
        return vdp.cluster.plan(
            f"ph-cut-{i}", prompts[i], "P-MD", vdp.sampling(i, MAX_TOKENS), main_hit_tokens=0
        )

    [first] = await vdp.run_all([plan(0)])
    assert first.token_ids == expected[0]
    link = vdp.cluster["md"].link
    link.partition(True)
    with pytest.raises(UpstreamError, match="p could not send the KV to md"):
        await vdp.run_all([plan(1)])
    link.partition(False)
    [last] = await vdp.run_all([plan(2)])
    assert last.token_ids == expected[2] and last.sources[-1] == "md"
    await vdp.assert_quiescent()


WORKERS = ((Role.PREFILL, "p"), (Role.RELAY, "rld"), (Role.MAIN, "md"))


async def complete(runtime: RouterRuntime, prompt: list[int], max_tokens: int) -> Generation:
    """One greedy completion through the router's serving code, read to its end."""
    request = CompletionRequest(
        model=runtime.config.served_name, prompt=prompt, max_tokens=max_tokens,
        temperature=0.0, ignore_eos=True,
    )  # fmt: skip
    generation = await OpenAIServing(runtime).start(prompt, request, max_tokens, "prompt")
    async for _ in generation.deltas():
        pass
    return generation


@pytest.mark.parametrize("md_computes", [False, True])
async def test_the_router_predicts_the_next_turn_from_what_md_was_sent(
    vdp, md_computes: bool
) -> None:
    """Through the router's own code, which polls MD's cache events only at start: it
    counts what it sent MD (the prompt) and what MD then computed (the answer) as MD's, so
    turn 2's prediction is the whole of turn 1 and only the new message crosses; or,
    where MD may compute its miss (the default), MD computes just that message and
    nothing crosses."""
    prompt = vdp.prompts(1, seed=87, lo=90, hi=91)[0]
    workers = WORKERS
    config = {} if md_computes else {"md_recompute_max_tokens": 0}

    async with vdp.cluster.router(workers, **config) as runtime:
        turn1 = await complete(runtime, prompt, MAX_TOKENS)
        assert turn1.route.pipeline == Pipeline.P_MD
        turn2 = prompt + turn1.token_ids + [7, 8, 9]
        delta = vdp.counters("p", "md")
        second = await complete(runtime, turn2, 4)
    held = (len(prompt) + MAX_TOKENS - 1) // vdp.block_size * vdp.block_size
    assert second.route.md_hit_tokens == held == delta("md", "pdd_worker_prefix_hit_tokens")
    assert second.route.md_computes_miss == md_computes
    crossed = 0 if md_computes else (len(turn2) - held) * vdp.kv_bytes_per_token
    assert delta("p", "pdd_worker_wan_kv_bytes") == crossed
    await vdp.assert_quiescent()


async def test_a_next_turn_sent_while_the_last_turns_kv_crosses_is_relayed(vdp) -> None:
    """The relay finishes turn 1 while its KV (90 tokens, about 0.15 s on a 0.01 Gbit/s
    line) is held on the line to MD. Turn 2 extends it by 3 tokens: alone, its 5-token
    miss would cross in a few ms (P-MD). But the router counts turn 1 as MD's already,
    and MD lets turn 1's KV land before it attaches turn 2, so MD's first token waits
    for all of it: over the 0.1 s budget, so the router relays turn 2 as well, and the
    client gets its tokens while the line is still held."""
    prompt = vdp.prompts(1, seed=88, lo=90, hi=91)[0]
    to_md = vdp.cluster.wan_path("md")
    config = {"link_gbps": 0.01, "ttft_budget_s": 0.1}
    async with vdp.cluster.router(WORKERS, **config) as runtime:
        to_md.pause()
        turn1 = await complete(runtime, prompt, 8)
        assert turn1.route.pipeline == Pipeline.P_RLD_MD
        turn2 = prompt + turn1.token_ids + [7, 8, 9]
        (expected,) = await vdp.reference([turn2], 4, "aw2")
        second = await complete(runtime, turn2, 4)
        assert second.route.pipeline == Pipeline.P_RLD_MD, second.route.reason
        assert second.route.md_hit_tokens == (len(turn2) - 4) // vdp.block_size * vdp.block_size
        assert second.token_ids == expected
        to_md.resume()
        await vdp.assert_quiescent()
