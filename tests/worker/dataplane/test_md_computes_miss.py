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


async def test_p_md_with_md_computing_its_miss_sends_no_kv(vdp) -> None:
    prompts = vdp.prompts(2, seed=91, lo=80, hi=81)
    expected = await vdp.reference(prompts, MAX_TOKENS, "mc-ref")
    delta = vdp.counters("p", "md")
    plans = [
        vdp.cluster.plan(
            f"mc-{i}",
            prompt,
            "P-MD",
            vdp.sampling(i, MAX_TOKENS),
            main_hit_tokens=0,
            md_computes_miss=True,
        )
        for i, prompt in enumerate(prompts)
    ]
    results = await vdp.run_all(plans)
    assert [r.token_ids for r in results] == expected
    assert all(r.sources == ["md"] * MAX_TOKENS for r in results)
    assert delta("p", "pdd_worker_wan_kv_bytes") == 0
    assert delta("p", "pdd_worker_transfer_failures") == 0
    await vdp.assert_quiescent()


async def test_md_computes_only_what_its_cache_lacks(vdp) -> None:
    """MD holds a conversation's first turn: it computes only the new turn's tokens."""
    first = vdp.prompts(1, seed=92, lo=64, hi=65)[0]
    turn = first + vdp.prompts(1, seed=93, lo=20, hi=21)[0]
    [expected] = await vdp.reference([turn], MAX_TOKENS, "mc-turn-ref")
    warm = vdp.cluster.plan("mc-warm", first, "P-MD", vdp.sampling(0, MAX_TOKENS))
    await vdp.run_all([warm])  # MD finishes it: the first turn stays in its cache
    delta = vdp.counters("p", "md")
    plan = vdp.cluster.plan(
        "mc-turn", turn, "P-MD", vdp.sampling(0, MAX_TOKENS), main_hit_tokens=0,
        md_computes_miss=True,
    )  # fmt: skip
    [result] = await vdp.run_all([plan])
    hit = result.events[0].md_hit_tokens
    assert result.token_ids == expected and hit is not None and hit >= 48
    assert delta("md", "pdd_worker_prefix_hit_tokens") == hit
    assert delta("p", "pdd_worker_wan_kv_bytes") == 0
    await vdp.assert_quiescent()


async def test_a_relayed_request_whose_md_computes_its_miss(vdp) -> None:
    """The relay serves first from P's exact KV on the fast path; MD computes the prompt
    and the relay's IDs in the hand-off, and the client gets mono's tokens."""
    prompts = vdp.prompts(2, seed=94, lo=70, hi=71)
    expected = await vdp.reference(prompts, MAX_TOKENS, "mc-rld-ref")
    delta = vdp.counters("p", "md")
    plans = [
        vdp.cluster.plan(
            f"mc-rld-{i}",
            prompt,
            "P-RLD-MD",
            vdp.sampling(i, MAX_TOKENS),
            main_hit_tokens=0,
            md_computes_miss=True,
        )
        for i, prompt in enumerate(prompts)
    ]
    results = await vdp.run_all(plans)
    assert [r.token_ids for r in results] == expected
    assert all(r.sources[0] == "rld" for r in results)
    assert delta("p", "pdd_worker_wan_kv_bytes") == 0
    await vdp.assert_quiescent()
