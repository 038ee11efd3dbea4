"""Faults: a peer dies or the WAN is cut mid-request; the request still ends cleanly.

The victims (``md_v``, ``rld_v``) are killed for good, so these tests run last
(see conftest). Each one slows the WAN to a trickle so that the fault lands
while the KV is in flight, then checks the client's stream (complete, equal to
mono, no duplicate) and that the survivors hold no request state, lock or block.
"""

from __future__ import annotations

import pytest

from pdd.worker.driver import PipelineError

TRICKLE_GBPS = 1e-5  # 10 kbit/s: the KV stays in flight until the fault
SLOW_GBPS = 0.0008  # ~100 KB/s: the KV arrives a second or two late
MAX_TOKENS = 40


async def test_main_decode_dies_mid_transfer(dp) -> None:
    prompt = dp.prompts(1, seed=51, lo=90, hi=91)[0]
    expected = await dp.reference([prompt], MAX_TOKENS, "f-md")
    victim = dp.cluster["md_v"]
    victim.link.set_rate(TRICKLE_GBPS)
    delta = dp.counters("p")

    def kill_md(event) -> None:
        if victim.proc.poll() is None:
            victim.kill()

    plan = dp.cluster.plan("f-md-0", prompt, "P-RLD-MD", dp.sampling(0, MAX_TOKENS), main="md_v")
    [result] = await dp.run_all([plan], on_token=kill_md)
    assert result.token_ids == expected[0]
    assert set(result.sources) == {"rld"} and result.duplicates == 0
    assert victim.proc.poll() is not None
    dp.assert_quiescent()
    assert delta("p", "pdd_transfer_failures", 'path="wan"') >= 1


async def test_relay_dies_before_handoff(dp) -> None:
    prompt = dp.prompts(1, seed=52, lo=90, hi=91)[0]
    expected = await dp.reference([prompt], MAX_TOKENS, "f-rld")
    victim, md_link = dp.cluster["rld_v"], dp.cluster["md"].link
    md_link.set_rate(SLOW_GBPS)  # MD's KV is late: the relay is alone when it dies

    def kill_relay_after_a_few_tokens(event) -> None:
        if event.seq >= 4 and victim.proc.poll() is None:
            victim.kill()

    plan = dp.cluster.plan("f-rld-0", prompt, "P-RLD-MD", dp.sampling(0, MAX_TOKENS), relay="rld_v")
    try:
        [result] = await dp.run_all([plan], on_token=kill_relay_after_a_few_tokens)
    finally:
        md_link.set_rate(1.0)
    assert result.token_ids == expected[0]
    assert result.duplicates == 0
    assert result.sources[0] == "rld_v" and result.sources[-1] == "md"
    dp.assert_quiescent()


async def test_wan_cut_ends_transfers_and_relay_finishes(dp) -> None:
    prompt = dp.prompts(1, seed=53, lo=90, hi=91)[0]
    expected = await dp.reference([prompt], MAX_TOKENS, "f-cut")
    link = dp.cluster["md"].link
    link.set_rate(TRICKLE_GBPS)
    delta = dp.counters("p")

    def cut(event) -> None:
        link.partition(True)

    plan = dp.cluster.plan("f-cut-0", prompt, "P-RLD-MD", dp.sampling(0, MAX_TOKENS))
    try:
        [result] = await dp.run_all([plan], on_token=cut)
        assert result.token_ids == expected[0]
        assert result.duplicates == 0 and set(result.sources) == {"rld"}
        # P's WAN transfer and MD's attached request end within the transfer timeout.
        dp.assert_quiescent()
        assert delta("p", "pdd_transfer_failures", 'path="wan"') == 1
    finally:
        link.partition(False)
        link.set_rate(1.0)


async def test_wan_cut_without_relay_fails_the_request_clearly(dp) -> None:
    prompt = dp.prompts(1, seed=54, lo=90, hi=91)[0]
    link = dp.cluster["md"].link
    link.set_rate(TRICKLE_GBPS)
    link.partition(True)
    try:
        plan = dp.cluster.plan("f-cut-pmd", prompt, "P-MD", dp.sampling(0, MAX_TOKENS))
        with pytest.raises(PipelineError, match="without a finish"):
            await dp.run_all([plan])
        dp.assert_quiescent()
    finally:
        link.partition(False)
        link.set_rate(1.0)
