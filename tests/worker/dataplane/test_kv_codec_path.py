"""A KV codec on the WAN path, end to end in process: P codes only what it sends MD,
the counters show raw and coded bytes, and a P and MD that disagree fail the transfer
at the handshake with a message naming both codecs (the relay carries the request).

On a virtual clock, so the transfers interleave the same way on every machine
(``cvdp``: P and ``md`` code int8, ``md_plain`` takes exact KV only).
"""

from __future__ import annotations

import re

import pytest

from pdd.common.kv_codec import handshake_name
from pdd.common.vocabulary import Role
from pdd.local.probes import flatten
from pdd.router.errors import UpstreamError
from pdd.router.openai_protocol import CompletionRequest
from pdd.router.route import md_computing_key, md_computing_tokens
from pdd.router.serving_base import OpenAIServing

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

MAX_TOKENS = 32


async def run_greedy(cvdp, prompts: list[list[int]], tag: str, pipeline: str, **kw) -> list:
    """Greedy (the quality bar is greedy agreement; a seeded draw near a boundary of the
    nucleus flips on any change of the probabilities, exact or not)."""
    plans = [
        cvdp.cluster.plan(f"{tag}-{i}", p, pipeline, cvdp.sampling(0, MAX_TOKENS), **kw)
        for i, p in enumerate(prompts)
    ]
    return [r.token_ids for r in await cvdp.run_all(plans)]


async def test_int8_ships_half_the_bytes_to_md_and_the_relay_stays_exact(cvdp) -> None:
    prompts = cvdp.prompts(4, seed=81, lo=100, hi=200)
    expected = await run_greedy(cvdp, prompts, "c-ref", "mono", main="mono")
    delta = cvdp.counters("p", "md")
    via_md = await run_greedy(cvdp, prompts, "c-md", "P-MD")
    raw, wire = delta("p", "pdd_worker_wan_kv_bytes"), delta("p", "pdd_worker_wan_kv_coded_bytes")
    md_miss = delta("md", "pdd_worker_prompt_tokens") - delta("md", "pdd_worker_prefix_hit_tokens")
    assert raw == md_miss * cvdp.kv_bytes_per_token  # the raw counter still counts raw KV
    assert 0 < wire <= 0.52 * raw  # float32 KV, head dim 16: int8 is about 0.31x with its scales
    agree = sum(
        a == b
        for got, want in zip(via_md, expected, strict=True)
        for a, b in zip(got, want, strict=True)
    )
    assert agree / (len(prompts) * MAX_TOKENS) >= 0.99
    # The relay's copy is exact: P-RLD (no WAN) gives mono's tokens, every one.
    assert await run_greedy(cvdp, prompts, "c-rld", "P-RLD") == expected
    await cvdp.assert_quiescent()


async def test_codec_mismatch_fails_the_handshake_and_the_relay_carries_on(cvdp) -> None:
    prompt = cvdp.prompts(1, seed=82, lo=90, hi=91)[0]
    expected = await cvdp.reference([prompt], MAX_TOKENS, "c-mis")
    delta = cvdp.counters("p", "md_plain")
    plan = cvdp.cluster.plan(
        "c-mis-0", prompt, "P-RLD-MD", cvdp.sampling(0, MAX_TOKENS), main="md_plain"
    )
    [result] = await cvdp.run_all([plan])
    assert result.token_ids == expected[0] and set(result.sources) == {"rld"}
    assert delta("p", "pdd_worker_transfer_failures", 'path="wan"') == 1
    assert delta("p", "pdd_worker_wan_kv_bytes") == 0  # refused before any KV was sent
    assert delta("md_plain", "pdd_worker_prompt_tokens") == 0  # nothing was attached
    await cvdp.assert_quiescent()


async def test_codec_mismatch_without_a_relay_names_both_codecs(cvdp) -> None:
    prompt = cvdp.prompts(1, seed=83, lo=90, hi=91)[0]
    plan = cvdp.cluster.plan(
        "c-mis-pmd", prompt, "P-MD", cvdp.sampling(0, MAX_TOKENS), main="md_plain"
    )
    offered = re.escape(repr(handshake_name("int8")))  # names the coded layout (int8.vN)
    with pytest.raises(UpstreamError, match=rf"coded {offered}.*takes 'none'.*kvCodec"):
        await cvdp.run_all([plan])
    await cvdp.assert_quiescent()


async def test_adaptive_md_decodes_the_codec_each_plan_names(avdp) -> None:
    """Under adaptive, the router names a codec per request: P codes MD's KV with it and
    MD, told which in the handshake, decodes it. The exact one gives mono's tokens, each
    lossy one fewer bytes than the last; a plan naming no codec sends the KV exact. (Fresh
    prompts per codec, so MD's cache holds none of them.)"""
    wire: dict[str | None, float] = {}
    for seed, codec in enumerate((None, "none", "int8", "int4")):
        prompts = avdp.prompts(2, seed=840 + seed, lo=100, hi=200)
        expected = await run_greedy(avdp, prompts, f"a-ref-{codec}", "mono", main="mono")
        delta = avdp.counters("p")
        got = await run_greedy(avdp, prompts, f"a-{codec}", "P-MD", kv_codec=codec)
        raw = delta("p", "pdd_worker_wan_kv_bytes")
        assert raw == sum(len(p) for p in prompts) * avdp.kv_bytes_per_token
        wire[codec] = delta("p", "pdd_worker_wan_kv_coded_bytes") / raw
        if codec in (None, "none"):
            assert got == expected
        else:  # decoded to the end (its quality: test_greedy_agreement, docs/kv-codec.md)
            assert [len(g) for g in got] == [MAX_TOKENS] * len(prompts)
    assert 1.0 <= wire[None] < 1.05 and 1.0 <= wire["none"] < 1.05  # chunk headers only
    assert wire["int4"] < wire["int8"] <= 0.52
    await avdp.assert_quiescent()


@pytest.mark.parametrize("codec", ["int8", "int4"])
async def test_adaptive_md_never_lets_a_later_turn_hit_kv_that_crossed_coded(avdp, codec) -> None:
    """Under adaptive, a turn whose KV crossed lossily (the line was slow then) leaves
    nothing of it in MD's prefix cache: the next turn, sent exact once the line
    recovered, gets its whole prompt's KV exact from P and answers as mono does. The
    same two turns with an exact first turn hit it (the cache still works)."""
    bpt = avdp.kv_bytes_per_token
    for tag, first_codec in ((f"lossy-{codec}", codec), (f"exact-{codec}", "none")):
        prompt = avdp.prompts(1, seed=870 if first_codec == "none" else 871, lo=100, hi=101)[0]
        (answer,) = await run_greedy(avdp, [prompt], f"t1-{tag}", "P-MD", kv_codec=first_codec)
        turn2 = prompt + answer + avdp.prompts(1, seed=872, lo=8, hi=9)[0]
        expected = await run_greedy(avdp, [turn2], f"t2-ref-{tag}", "mono", main="mono")
        delta = avdp.counters("p")
        got = await run_greedy(avdp, [turn2], f"t2-{tag}", "P-MD", kv_codec="none")
        shipped = delta("p", "pdd_worker_wan_kv_bytes") / bpt
        assert got == expected
        if first_codec == "none":  # MD held turn 1's full blocks: only the rest crossed
            held = (len(prompt) + len(answer) - 1) // avdp.block_size * avdp.block_size
            assert shipped == len(turn2) - held
        else:
            assert shipped == len(turn2)
    await avdp.assert_quiescent()


async def test_a_fixed_int8_deployment_keeps_reusing_its_coded_kv(cvdp) -> None:
    """With one codec for every transfer (``--kv-codec int8``) MD's cache holds the coded
    KV as before: every turn's is coded alike, and the next turn misses only what is new."""
    prompt = cvdp.prompts(1, seed=873, lo=100, hi=101)[0]
    (answer,) = await run_greedy(cvdp, [prompt], "fixed-t1", "P-MD")
    turn2 = prompt + answer + cvdp.prompts(1, seed=874, lo=8, hi=9)[0]
    delta = cvdp.counters("p")
    await run_greedy(cvdp, [turn2], "fixed-t2", "P-MD")
    held = (len(prompt) + len(answer) - 1) // cvdp.block_size * cvdp.block_size
    assert delta("p", "pdd_worker_wan_kv_bytes") == (len(turn2) - held) * cvdp.kv_bytes_per_token
    await cvdp.assert_quiescent()


async def test_a_fixed_md_refuses_a_codec_the_router_chose_for_adaptive(avdp) -> None:
    """An MD left at none (not adaptive) refuses int8 at the handshake, naming both."""
    prompt = avdp.prompts(1, seed=85, lo=90, hi=91)[0]
    plan = avdp.cluster.plan(
        "a-mis", prompt, "P-MD", avdp.sampling(0, MAX_TOKENS), main="md_plain", kv_codec="int8"
    )
    offered = re.escape(repr(handshake_name("int8")))
    with pytest.raises(UpstreamError, match=rf"coded {offered}.*takes 'none'"):
        await avdp.run_all([plan])
    await avdp.assert_quiescent()


async def test_the_adaptive_router_names_its_codec_in_the_plan_reason_and_counter(avdp) -> None:
    """The router under ``--kv-codec adaptive``, with no relay (P-MD serves whatever the
    line does), on a line declared too slow for the exact KV of a new 200-token prompt
    within the budget (0.33 s at 0.01 Gbit/s against 0.2 s), but not for int8's: it codes
    that prompt int8, and says so in the reason (the ``x-pdd-reason`` header's text) and
    the labelled counter (with a relay it would relay the exact KV: test_policy; MD,
    left to compute misses, would compute this one: test_md_computes_miss). A
    short conversation's KV fits exact, and its next turn's few new tokens too (MD
    holds the first turn).
    The coded turn left nothing in MD's cache, and the router's index knows it: its
    next turn counts on no hit there and is coded again."""
    workers = ((Role.PREFILL, "p"), (Role.MAIN, "md"))
    long, short = (
        avdp.prompts(2, seed=86, lo=200, hi=201)[0],
        avdp.prompts(1, seed=88, lo=60, hi=61)[0],
    )
    new_tokens = avdp.prompts(1, seed=87, lo=8, hi=9)[0]
    async with avdp.cluster.router(
        workers, kv_codec="adaptive", link_gbps=0.01, link_rtt_ms=4.0, ttft_budget_s=0.2,
        prefill_tokens_per_s=1e6, static_link_view=True, md_recompute_max_tokens=0,
    ) as rt:  # fmt: skip
        serving = OpenAIServing(rt)
        first = await complete(serving, rt, short)
        assert first.route.kv_codec == "none" and "KV coded none" in first.route.reason
        second = await complete(serving, rt, short + first.token_ids + new_tokens)
        assert second.route.kv_codec == "none" and second.route.md_hit_tokens > len(short)
        coded = await complete(serving, rt, long)
        assert coded.route.kv_codec == "int8" and "KV coded int8" in coded.route.reason
        assert coded.route.kv_bytes < len(long) * avdp.kv_bytes_per_token * 0.52
        assert len(coded.token_ids) == MAX_TOKENS
        after = await complete(serving, rt, long + coded.token_ids + new_tokens)
        assert after.route.md_hit_tokens == 0 and after.route.kv_codec in ("int8", "int4")
        metrics = flatten(rt.metrics.render().decode())
        choices = {
            c: metrics.get(f'pdd_router_kv_codec_choices_total{{codec="{c}"}}', 0)
            for c in ("none", "int8", "int4")
        }
        assert choices["none"] == 2 and choices["int8"] + choices["int4"] == 2
        assert choices[after.route.kv_codec] >= 1
    await avdp.assert_quiescent()


async def test_the_adaptive_router_has_md_compute_a_small_miss_by_default(avdp) -> None:
    """The same router and line with MD computing left at its default (misses of up to
    4,096 tokens): the long prompt's exact KV misses the budget, and MD computing its
    200 tokens (at the declared 1,000,000 tokens/s) fits it, so no codec is used. The
    route, its reason and the counter say so; P puts no KV on the line, and the tokens
    are mono's. Where MD is computing other requests' misses (the replicas' shared
    in-flight counts), a new miss waits behind them: coded instead."""
    workers = ((Role.PREFILL, "p"), (Role.MAIN, "md"))
    long = avdp.prompts(1, seed=86, lo=200, hi=201)[0]
    other = avdp.prompts(1, seed=89, lo=200, hi=201)[0]
    [expected] = await run_greedy(avdp, [long], "a-ref", "mono", main="mono")
    delta = avdp.counters("p")
    async with avdp.cluster.router(
        workers, kv_codec="adaptive", link_gbps=0.01, link_rtt_ms=4.0, ttft_budget_s=0.2,
        prefill_tokens_per_s=1e6, static_link_view=True,
    ) as rt:  # fmt: skip
        computed = await complete(OpenAIServing(rt), rt, long)
        assert computed.route.md_computes_miss and computed.route.kv_bytes == 0
        assert computed.route.md_compute_tokens == len(long)
        assert "KV computed at MD" in computed.route.reason
        assert computed.token_ids == expected
        metrics = flatten(rt.metrics.render().decode())
        assert metrics.get('pdd_router_kv_codec_choices_total{codec="computed_at_md"}') == 1
        assert md_computing_tokens(await rt.store.inflight()) == {}  # let go at its end
        # Another replica's requests have MD computing 1,000,000 tokens (1 s of it): the
        # next miss would wait behind them, so it is coded instead.
        rt.store.add_inflight(md_computing_key("md"), 1_000_000)
        queued = await complete(OpenAIServing(rt), rt, other)
        assert not queued.route.md_computes_miss and queued.route.kv_codec == "int8"
        rt.store.add_inflight(md_computing_key("md"), -1_000_000)
    assert delta("p", "pdd_worker_wan_kv_bytes") > 0  # only the coded one crossed
    await avdp.assert_quiescent()


async def complete(serving: OpenAIServing, rt, prompt: list[int]):
    """One greedy completion through the router's serving layer, read to the end."""
    request = CompletionRequest(
        model=rt.config.served_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
        ignore_eos=True,
    )  # fmt: skip
    generation = await serving.start(prompt, request, MAX_TOKENS, "prompt")
    async for _ in generation.deltas():
        pass
    return generation
