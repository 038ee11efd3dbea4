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
from pdd.router.errors import UpstreamError

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
