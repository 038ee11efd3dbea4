"""MD computes the KV it lacks from the prompt's IDs (``PipelinePlan.md_computes_miss``).

In-process on a virtual clock. The router chooses it under ``kvCodec: adaptive`` where
no transfer would bring MD's miss in time: P sends MD the first token and no KV, and MD
prefills its miss (beyond what its cache holds) before it decodes on. The client still
gets mono's tokens, on P-MD and after a relay's hand-off alike.
"""

from __future__ import annotations

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
    results = await run_computing(vdp, 91, "P-MD", "mc")
    assert all(r.sources == ["md"] * MAX_TOKENS for r in results)
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
