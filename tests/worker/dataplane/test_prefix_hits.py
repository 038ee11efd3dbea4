"""Token streams carry the prefix hits the workers measured, for the router's usage and index.

``cached_tokens`` on seq 0 is P's own hit (it equals P's hit counter); the main
decode puts its handshake hit on the first event it streams.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

MAX_TOKENS = 48


def hits(result) -> list[tuple[int, str, int | None, int | None]]:
    """(seq, source, cached_tokens, md_hit_tokens) of the events that carry either."""
    return [
        (e.seq, e.source, e.cached_tokens, e.md_hit_tokens)
        for e in result.events
        if e.cached_tokens is not None or e.md_hit_tokens is not None
    ]


async def test_streams_report_the_real_hits_of_p_and_md(dp) -> None:
    prompt = dp.prompts(1, seed=61, lo=96, hi=97)[0]
    n, bs = len(prompt), dp.block_size
    p_hit = (n - 1) // bs * bs  # P matches all but the last prompt token: 80 of 96
    sampling = dp.sampling(0, MAX_TOKENS)

    (cold,) = await dp.run_all([dp.cluster.plan("hits-cold", prompt, "P-MD", sampling)])
    assert hits(cold) == [(0, "md", 0, 0)]

    delta = dp.counters("p", "md")
    (warm,) = await dp.run_all([dp.cluster.plan("hits-warm", prompt, "P-MD", sampling)])
    assert hits(warm) == [(0, "md", p_hit, n)]  # MD's DRC kept the whole prompt
    assert delta("p", "pdd_worker_prefix_hit_tokens") == p_hit
    assert delta("md", "pdd_worker_prefix_hit_tokens") == n

    plan = dp.cluster.plan("hits-relay", prompt, "P-RLD-MD", sampling, handoff="one-shot")
    (relayed,) = await dp.run_all([plan])
    assert hits(relayed)[0] == (0, "rld", p_hit, None)  # the relay streams seq 0
    from_md = [h for h in hits(relayed) if h[1] == "md"]
    assert len(from_md) <= 1  # only MD's first event carries its hit (none if RLD finished)
    assert all(h[3] == n for h in from_md)
    assert warm.token_ids == cold.token_ids == relayed.token_ids
    await dp.assert_quiescent()
