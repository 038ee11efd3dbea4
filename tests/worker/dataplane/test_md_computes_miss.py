"""MD computes the KV it lacks from the prompt's IDs (``PipelinePlan.md_computes_miss``).

In-process on a virtual clock. The router chooses it where that is sooner than the KV's
crossing (and, under ``kvCodec: adaptive``, where no transfer would bring MD's miss in
time). On P-MD P computes nothing (``PipelinePlan.md_prefills``): MD prefills its miss
(beyond what its cache holds) and samples the first token itself. On P-RLD-MD P
prefills for the relay and sends MD the first token and no KV. The client still gets
mono's tokens, on P-MD and after a relay's hand-off alike.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

MAX_TOKENS = 24


def computing_plan(vdp, tag: str, prompt: list[int], pipeline: str, i: int = 0):
    """A plan whose MD computes its miss (P predicts MD holds nothing)."""
    sampling = vdp.sampling(i, MAX_TOKENS)
    return vdp.cluster.plan(
        tag, prompt, pipeline, sampling, main_hit_tokens=0, md_computes_miss=True
    )


async def run_computing(vdp, seed: int, pipeline: str, tag: str) -> list:
    """Two prompts through ``pipeline`` with MD computing its miss: each gives mono's
    tokens and P sends no KV across the WAN."""
    prompts = vdp.prompts(2, seed=seed, lo=80, hi=81)
    expected = await vdp.reference(prompts, MAX_TOKENS, f"{tag}-ref")
    delta = vdp.counters("p", "md")
    plans = [computing_plan(vdp, f"{tag}-{i}", p, pipeline, i) for i, p in enumerate(prompts)]
    results = await vdp.run_all(plans)
    assert [r.token_ids for r in results] == expected
    assert delta("p", "pdd_worker_wan_kv_bytes") == 0
    assert delta("p", "pdd_worker_transfer_failures") == 0
    return results


async def test_p_md_with_md_computing_its_miss_sends_no_kv(vdp) -> None:
    """P computes nothing: no prompt token is counted there, and P's cache stays empty."""
    delta = vdp.counters("p")
    results = await run_computing(vdp, 91, "P-MD", "mc")
    assert all(r.sources == ["md"] * MAX_TOKENS for r in results)
    assert delta("p", "pdd_worker_prompt_tokens") == 0
    assert all(r.events[0].cached_tokens == 0 for r in results)  # MD's hit: it held nothing
    await vdp.assert_quiescent()


async def test_md_prefilling_gives_mono_s_logprobs(vdp) -> None:
    """MD samples the first token itself: its logprobs (and every later one's) are mono's."""
    prompts = vdp.prompts(3, seed=95, lo=60, hi=90)
    mono = [
        vdp.cluster.plan(f"mc-lp-mono-{i}", p, "mono", vdp.steered(i, MAX_TOKENS), main="mono")
        for i, p in enumerate(prompts)
    ]
    computing = [
        vdp.cluster.plan(
            f"mc-lp-{i}", p, "P-MD", vdp.steered(i, MAX_TOKENS), main_hit_tokens=0,
            md_computes_miss=True,
        )
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    reference, results = await vdp.run_all(mono), await vdp.run_all(computing)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    for got, want in zip(results, reference, strict=True):
        for g, w in zip(got.tokens, want.tokens, strict=True):
            assert g.logprobs is not None and w.logprobs is not None
            assert g.logprobs.logprob == pytest.approx(w.logprobs.logprob, abs=1e-4)
    await vdp.assert_quiescent()


async def test_md_prefilling_a_prompt_its_cache_holds_whole_computes_its_last_token(vdp) -> None:
    """MD holds every block of the prompt (a whole number of blocks it served before): it
    still has a token to compute for the first one, and gives mono's tokens."""
    prompt = vdp.prompts(1, seed=96, lo=4 * vdp.block_size, hi=4 * vdp.block_size + 1)[0]
    [expected] = await vdp.reference([prompt], MAX_TOKENS, "mc-whole-ref")
    warm = vdp.cluster.plan("mc-whole-warm", prompt, "P-MD", vdp.sampling(0, MAX_TOKENS))
    await vdp.run_all([warm])
    [result] = await vdp.run_all([computing_plan(vdp, "mc-whole", prompt, "P-MD")])
    assert result.token_ids == expected
    assert result.events[0].md_hit_tokens == len(prompt) - vdp.block_size
    await vdp.assert_quiescent()


async def test_md_computes_only_what_its_cache_lacks(vdp) -> None:
    """MD holds a conversation's first turn: it computes only the new turn's tokens."""
    first = vdp.prompts(1, seed=92, lo=64, hi=65)[0]
    turn = first + vdp.prompts(1, seed=93, lo=20, hi=21)[0]
    [expected] = await vdp.reference([turn], MAX_TOKENS, "mc-turn-ref")
    warm = vdp.cluster.plan("mc-warm", first, "P-MD", vdp.sampling(0, MAX_TOKENS))
    await vdp.run_all([warm])  # MD finishes it: the first turn stays in its cache
    delta = vdp.counters("p", "md")
    [result] = await vdp.run_all([computing_plan(vdp, "mc-turn", turn, "P-MD")])
    hit = result.events[0].md_hit_tokens
    assert result.token_ids == expected and hit is not None and hit >= 48
    assert delta("md", "pdd_worker_prefix_hit_tokens") == hit
    assert delta("p", "pdd_worker_wan_kv_bytes") == 0
    await vdp.assert_quiescent()


async def test_a_relayed_request_whose_md_computes_its_miss(vdp) -> None:
    """The relay serves first from P's exact KV on the fast path; MD computes the prompt
    and the relay's IDs in the hand-off, and the client gets mono's tokens."""
    results = await run_computing(vdp, 94, "P-RLD-MD", "mc-rld")
    assert all(r.sources[0] == "rld" for r in results)
    await vdp.assert_quiescent()


@pytest.mark.parametrize("md_prefills", [True, False])
async def test_md_prefilling_does_not_wait_for_an_earlier_turn_still_landing(
    vdp, md_prefills: bool
) -> None:
    """MD expects an earlier turn's KV that has not landed (its hand-off still running).
    An exact P-MD next turn waits for it, bounded, so that KV does not cross twice; MD
    prefilling computes what has not landed, at once, and gives mono's tokens either way."""
    first = vdp.prompts(1, seed=97, lo=64, hi=65)[0]
    turn = first + vdp.prompts(1, seed=98, lo=20, hi=21)[0]
    [expected] = await vdp.reference([turn], MAX_TOKENS, f"mc-land-{md_prefills}-ref")
    md = vdp.cluster["md"].role
    bound_s = md.settings.transport.connect_timeout_s / 2
    md.landing.expect("an-earlier-turn", first)  # announced, never landing
    try:
        tag = f"mc-land-{md_prefills}"
        if md_prefills:
            plan = computing_plan(vdp, tag, turn, "P-MD")
        else:
            plan = vdp.cluster.plan(tag, turn, "P-MD", vdp.sampling(0, MAX_TOKENS))
        loop = asyncio.get_running_loop()
        started = loop.time()
        [result] = await vdp.run_all([plan])
        waited_s = loop.time() - started
    finally:
        md.landing.landed("an-earlier-turn")
    assert result.token_ids == expected
    assert (waited_s >= bound_s) != md_prefills
    await vdp.assert_quiescent()
