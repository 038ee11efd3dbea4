"""Real worker processes die mid-request (SIGKILL); the request still ends cleanly.

The victims (``md_v``, ``rld_v``) are killed for good; no other test uses them.
Each test holds MD's line to a trickle so the KV is still in flight when the
victim dies, then checks what holds in every interleaving of processes on a
busy machine: the client's stream is complete, equal to mono, without a
duplicate, and the survivors hold no request state, lock or block. The exact
paths (which instance streamed which token) are pinned down in-process, on a
virtual clock, by ``test_worker_crashes``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

TRICKLE_GBPS = 1e-5  # 10 kbit/s: a prompt's KV stays in flight for minutes
MAX_TOKENS = 40


async def test_main_decode_dies_mid_transfer(dp) -> None:
    prompt = dp.prompts(1, seed=51, lo=90, hi=91)[0]
    expected = await dp.reference([prompt], MAX_TOKENS, "f-md")
    victim = dp.cluster["md_v"]
    victim.link.set_rate(TRICKLE_GBPS)  # MD cannot have its KV before it dies
    delta = dp.counters("p")

    def kill_md(event) -> None:
        if victim.proc.poll() is None:
            victim.kill()

    plan = dp.cluster.plan("f-md-0", prompt, "P-RLD-MD", dp.sampling(0, MAX_TOKENS), main="md_v")
    [result] = await dp.run_all([plan], on_token=kill_md)
    assert result.token_ids == expected[0]
    assert set(result.sources) == {"rld"} and result.duplicates == 0
    assert victim.proc.poll() is not None
    await dp.assert_quiescent()  # P holds the KV until its WAN transfer has ended
    assert delta("p", "pdd_worker_transfer_failures", 'path="wan"') == 1


async def test_relay_dies_before_handoff(dp) -> None:
    prompt = dp.prompts(1, seed=52, lo=90, hi=91)[0]
    expected = await dp.reference([prompt], MAX_TOKENS, "f-rld")
    victim, md_link = dp.cluster["rld_v"], dp.cluster["md"].link
    md_link.set_rate(TRICKLE_GBPS)  # no handoff can happen while the relay lives

    def kill_relay_then_restore_md(event) -> None:
        if victim.proc.poll() is None:
            victim.kill()
            md_link.set_rate(1.0)

    plan = dp.cluster.plan("f-rld-0", prompt, "P-RLD-MD", dp.sampling(0, MAX_TOKENS), relay="rld_v")
    try:
        [result] = await dp.run_all([plan], on_token=kill_relay_then_restore_md)
    finally:
        md_link.set_rate(1.0)
    assert result.token_ids == expected[0]
    assert result.duplicates == 0 and result.sources[0] == "rld_v"
    assert victim.proc.poll() is not None
    await dp.assert_quiescent()
