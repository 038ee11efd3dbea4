"""Every pipeline and handoff mode streams exactly what the colocated mono instance does.

Each case is one batch of 50 concurrent requests (greedy and seeded sampling
mixed) checked token by token against mono, plus the byte counters: only MD's
miss crosses the WAN, the handoff carries token IDs, and nothing leaks.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration

N = 50
MAX_TOKENS = 12
#: Wire bytes per request besides KV: handshake, plan, chunk headers, replies (a few KB).
_PER_REQUEST_OVERHEAD = 4096


@pytest.fixture(scope="module")
def batch(dp) -> tuple[list[list[int]], list[list[int]]]:
    prompts = dp.prompts(N, seed=11)
    return prompts, asyncio.run(dp.reference(prompts, MAX_TOKENS, "eq"))


@pytest.mark.parametrize(
    ("pipeline", "handoff"),
    [
        ("P-RLD-MD", "one-shot"),
        ("P-RLD-MD", "catch-up"),
        ("P-MD", "auto"),
        ("P-RLD", "auto"),
        ("naive", "auto"),
    ],
)
async def test_pipeline_equals_mono(dp, batch, pipeline: str, handoff: str) -> None:
    prompts, expected = batch
    # A tiny catch-up threshold makes the catch-up case hand over in several chunks.
    threshold = 2 if handoff == "catch-up" else 64
    plans = [
        dp.cluster.plan(
            f"eq-{pipeline}-{handoff}-{i}", p, pipeline, dp.sampling(i, MAX_TOKENS),
            handoff=handoff, catchup_threshold=threshold,
        )
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    delta = dp.counters("p", "rld", "md")
    results = await dp.run_all(plans)

    assert [r.token_ids for r in results] == expected
    assert all(r.duplicates == 0 and not r.errors for r in results)
    first_sources = {r.sources[0] for r in results}
    assert "p" not in first_sources  # the first token always comes from the decode side

    bpt = dp.kv_bytes_per_token
    n = len(plans)
    md_miss = delta("md", "pdd_worker_prompt_tokens") - delta("md", "pdd_worker_prefix_hit_tokens")
    wan, wan_wire = (
        delta("p", "pdd_worker_wan_kv_bytes"),
        delta("p", "pdd_worker_wan_wire_bytes"),
    )
    if pipeline in ("P-RLD-MD", "P-MD", "naive"):
        assert md_miss > 0
        assert wan == md_miss * bpt  # only MD's miss crosses the WAN
        assert wan <= wan_wire <= 1.01 * wan + _PER_REQUEST_OVERHEAD * n
    else:
        assert wan == wan_wire == 0  # P-RLD: nothing crosses the WAN
    # P times each prompt it prefills; the decode side prefills nothing (its KV came from P)
    prefills = "pdd_worker_request_prefill_time_seconds_count"
    assert delta("p", prefills, 'role="prefill"', gauge=True) == n
    assert (
        delta("p", "pdd_worker_request_prefill_time_seconds_sum", 'role="prefill"', gauge=True) > 0
    )
    assert delta("md", prefills, 'role="main"', gauge=True) == 0
    assert delta("rld", prefills, 'role="relay"', gauge=True) == 0
    # ... and each request's wait in its queue, once: the decode side queues none of them
    queued = "pdd_worker_request_queue_time_seconds_count"
    assert delta("p", queued, 'role="prefill"', gauge=True) == n
    assert delta("md", queued, 'role="main"', gauge=True) == 0
    assert delta("rld", queued, 'role="relay"', gauge=True) == 0
    if pipeline in ("P-RLD-MD", "P-RLD"):
        rld_miss = delta("rld", "pdd_worker_prompt_tokens") - delta(
            "rld", "pdd_worker_prefix_hit_tokens"
        )
        assert delta("p", "pdd_worker_fastpath_kv_bytes") == rld_miss * bpt
    await dp.assert_quiescent()


async def test_naive_ships_the_full_kv_even_when_md_holds_the_prefix(dp) -> None:
    """The naive baseline bypasses MD's cache (the DRC), and leaves it to everyone else."""
    prompt = dp.prompts(1, seed=5, lo=96, hi=97)[0]
    n, bpt = len(prompt), dp.kv_bytes_per_token
    await dp.run_all([dp.cluster.plan("naive-warm", prompt, "P-MD", dp.sampling(0, 4))])
    delta = dp.counters("p", "md")
    for i in range(2):
        plan = dp.cluster.plan(f"naive-rep-{i}", prompt, "naive", dp.sampling(0, 4))
        (result,) = await dp.run_all([plan])
        assert result.events[0].md_hit_tokens is None  # no handshake hit to report
    assert delta("md", "pdd_worker_prefix_hit_tokens") == 0
    assert delta("p", "pdd_worker_wan_kv_bytes") == 2 * n * bpt
    # MD still holds the prompt from the P-MD turn: the naive requests neither evicted nor
    # replaced it.
    plan = dp.cluster.plan("naive-after", prompt, "P-MD", dp.sampling(0, 4))
    (after,) = await dp.run_all([plan])
    assert after.events[0].md_hit_tokens == n
    await dp.assert_quiescent()


@pytest.mark.parametrize(
    ("pipeline", "handoff"), [("P-RLD-MD", "one-shot"), ("P-RLD-MD", "catch-up"), ("P-MD", "auto")]
)
async def test_steered_sampling_and_logprobs_equal_mono(dp, pipeline: str, handoff: str) -> None:
    """Penalties, logit bias, min_tokens and logprobs across real processes: the same tokens
    as mono, and the same logprobs within 1e-4 from whichever instance sampled each."""
    prompts = dp.prompts(12, seed=13)
    reference = await dp.run_all(
        [
            dp.cluster.plan(f"st-mono-{pipeline}-{handoff}-{i}", p, "mono",
                            dp.steered(i, MAX_TOKENS), main="mono")
            for i, p in enumerate(prompts)
        ]
    )  # fmt: skip
    threshold = 2 if handoff == "catch-up" else 64
    plans = [
        dp.cluster.plan(
            f"st-{pipeline}-{handoff}-{i}", p, pipeline, dp.steered(i, MAX_TOKENS),
            handoff=handoff, catchup_threshold=threshold,
        )
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    results = await dp.run_all(plans)

    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    for got, want in zip(results, reference, strict=True):
        assert got.duplicates == 0 and not got.errors
        for g, w in zip(got.tokens, want.tokens, strict=True):
            assert g.logprobs is not None and w.logprobs is not None
            assert g.logprobs.logprob == pytest.approx(w.logprobs.logprob, abs=1e-4)
            assert [t.token_id for t in g.logprobs.top] == [t.token_id for t in w.logprobs.top]
    await dp.assert_quiescent()
