"""Handoffs after RLD ran past the catch-up threshold, the mode policy, and the DRC.

The WAN link to MD is throttled to a trickle until every request has streamed
more than the default threshold (64) from RLD, then restored: MD's KV arrives
late, exactly the case PDD's relay exists for.
"""

from __future__ import annotations

import pytest

from pdd.common.handoff import choose_handoff_mode
from pdd.common.wire import BlockStored, CacheEventsPage

#: ~375 KB/s, shared: the four prompts' KV (60-100 tokens of 2 KB each) takes about two
#: seconds, during which RLD decodes far past the threshold (64) but, with this many tokens
#: to go, not to the end.
SLOW_GBPS = 0.003
MAX_TOKENS = 600


async def test_late_kv_handoff_in_both_modes_matches_mono(dp) -> None:
    prompts = dp.prompts(4, seed=21, lo=60, hi=100)
    expected = await dp.reference(prompts, MAX_TOKENS, "late")
    modes = ["catch-up", "one-shot", "catch-up", "one-shot"]
    plans = [
        dp.cluster.plan(f"late-{i}", p, "P-RLD-MD", dp.sampling(i, MAX_TOKENS), handoff=m)
        for i, (p, m) in enumerate(zip(prompts, modes, strict=True))
    ]
    link = dp.cluster["md"].link
    delta = dp.counters("rld", "md")
    link.set_rate(SLOW_GBPS)
    try:
        results = await dp.run_all(plans)
    finally:
        link.set_rate(1.0)

    assert [r.token_ids for r in results] == expected
    assert all(r.duplicates == 0 for r in results)
    for r in results:  # RLD streamed the start, MD the end
        assert r.sources[0] == "rld" and r.sources[-1] == "md"
        assert r.sources.index("md") > 64
    assert delta("rld", "pdd_handoff", 'mode="catch-up"') == 2
    assert delta("rld", "pdd_handoff", 'mode="one-shot"') == 2
    assert delta("rld", "pdd_handoff_tokens") > 4 * 64
    dp.assert_quiescent()


@pytest.mark.parametrize(
    ("plan_mode", "worker_mode", "load", "expected"),
    [
        ("one-shot", "catch-up", 0.0, "one-shot"),
        ("catch-up", "one-shot", 1.0, "catch-up"),
        ("auto", "one-shot", 0.0, "one-shot"),
        ("auto", "auto", 0.2, "catch-up"),
        ("auto", "auto", 0.9, "one-shot"),
    ],
)
def test_handoff_mode_policy(plan_mode: str, worker_mode: str, load: float, expected: str) -> None:
    assert choose_handoff_mode(plan_mode, worker_mode, load, level=0.5) == expected


async def test_second_turn_hits_main_decode_radix_cache(dp) -> None:
    """Turn 2 = turn 1's prompt + answer + a new message: only the new part crosses the WAN."""
    turn1 = dp.prompts(6, seed=31, lo=50, hi=90)
    out1 = await dp.reference(turn1, 24, "mt1")
    plans1 = [
        dp.cluster.plan(f"mt1-{i}", p, "P-MD" if i % 2 else "P-RLD-MD", dp.sampling(i, 24))
        for i, p in enumerate(turn1)
    ]
    assert [r.token_ids for r in await dp.run_all(plans1)] == out1

    new_msgs = dp.prompts(6, seed=32, lo=10, hi=30)
    turn2 = [p + o + m for p, o, m in zip(turn1, out1, new_msgs, strict=True)]
    expected = await dp.reference(turn2, 8, "mt2")
    delta = dp.counters("p", "md")
    plans2 = [
        dp.cluster.plan(f"mt2-{i}", p, "P-RLD-MD", dp.sampling(i, 8)) for i, p in enumerate(turn2)
    ]
    assert [r.token_ids for r in await dp.run_all(plans2)] == expected

    bs = dp.block_size
    # MD cached each turn-1 prompt and (where it decoded to the end) the answer too.
    least_hit = sum(len(p) // bs * bs for p in turn1)
    hit = delta("md", "pdd_prefix_hit_tokens")
    assert hit >= least_hit
    miss = sum(len(p) for p in turn2) - hit
    assert delta("p", "pdd_wan_bytes") == miss * dp.kv_bytes_per_token
    dp.assert_quiescent()


async def test_p_md_caches_the_whole_conversation(dp) -> None:
    """Without a relay MD decodes everything: turn 2 hits every full block of turn 1."""
    prompt = dp.prompts(1, seed=41, lo=70, hi=71)[0]
    out = await dp.reference([prompt], 30, "pmd1")
    await dp.run_all([dp.cluster.plan("pmd1-0", prompt, "P-MD", dp.sampling(0, 30))])
    turn2 = prompt + out[0] + [7, 8, 9]
    delta = dp.counters("md")
    await dp.run_all([dp.cluster.plan("pmd2-0", turn2, "P-MD", dp.sampling(0, 4))])
    computed = len(prompt) + len(out[0]) - 1  # the last sampled token has no KV yet
    assert delta("md", "pdd_prefix_hit_tokens") == computed // dp.block_size * dp.block_size
    dp.assert_quiescent()


def test_cache_events_are_published_with_cursors(dp) -> None:
    import httpx

    md = dp.cluster["md"]
    auth = {"Authorization": f"Bearer {dp.cluster.secret}"}
    url = f"{md.url}/v1/pdd/cache-events"
    assert httpx.get(url).status_code == 401
    first = CacheEventsPage.model_validate(httpx.get(url, params={"since": 0}, headers=auth).json())
    assert first.instance_id == "md" and not first.reset
    assert any(isinstance(e, BlockStored) for e in first.events)
    assert first.next_cursor >= len(first.events)
    again = CacheEventsPage.model_validate(
        httpx.get(url, params={"since": first.next_cursor}, headers=auth).json()
    )
    assert again.events == [] or again.next_cursor > first.next_cursor
    future = httpx.get(url, params={"since": first.next_cursor + 10_000}, headers=auth).json()
    assert CacheEventsPage.model_validate(future).reset  # a cursor from another life
