"""A worker dies mid-request (in-process, at an exact point): the survivors carry the request.

``crash`` does to the network and the HTTP streams what SIGKILL does to a process,
on a virtual clock, so the death lands exactly where the test puts it: before the
relay could finish, while MD's KV is held on the line. The same faults with real
processes and signals are in ``test_process_faults``.
"""

from __future__ import annotations

import asyncio

import pytest

from pdd.router.errors import UpstreamError

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

MAX_TOKENS = 40


async def test_main_decode_dies_mid_transfer_and_relay_finishes(vdp) -> None:
    prompt = vdp.prompts(1, seed=51, lo=90, hi=91)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "c-md")
    vdp.cluster.wan_path("md_v").pause()  # MD's KV cannot arrive before it dies
    delta = vdp.counters("p")

    def kill_md(event) -> None:
        if vdp.cluster["md_v"].alive:
            vdp.cluster.crash("md_v")

    plan = vdp.cluster.plan("c-md-0", prompt, "P-RLD-MD", vdp.sampling(0, MAX_TOKENS), main="md_v")
    [result] = await vdp.run_all([plan], on_token=kill_md)
    assert result.token_ids == expected[0]
    assert set(result.sources) == {"rld"} and result.duplicates == 0
    assert "md_v" in result.errors  # the router saw MD's stream break and routed around it
    await vdp.assert_quiescent()
    assert delta("p", "pdd_worker_transfer_failures", 'path="wan"') == 1


@pytest.mark.parametrize("at_token", [0, 4, 30])
async def test_relay_dies_before_handoff_and_main_decode_continues(vdp, at_token: int) -> None:
    prompt = vdp.prompts(1, seed=52, lo=90, hi=91)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "c-rld")
    path = vdp.cluster.wan_path("md")
    path.pause()  # no handoff can happen while the relay lives

    def kill_relay_then_release_md(event) -> None:
        if event.seq >= at_token and vdp.cluster["rld_v"].alive:
            vdp.cluster.crash("rld_v")
            path.resume()

    plan = vdp.cluster.plan(
        "c-rld-0", prompt, "P-RLD-MD", vdp.sampling(0, MAX_TOKENS), relay="rld_v"
    )
    [result] = await vdp.run_all([plan], on_token=kill_relay_then_release_md)
    assert result.token_ids == expected[0]
    assert result.duplicates == 0
    # The relay streamed what had reached the client when it died (at least up to the
    # token it died at); MD continued right after the last of those, exactly.
    handed = result.sources.index("md")
    assert handed > at_token
    assert result.sources == ["rld_v"] * handed + ["md"] * (MAX_TOKENS - handed)
    await vdp.assert_quiescent()


async def test_prefill_dies_mid_kv_and_main_decode_names_it_as_the_cause(vdp) -> None:
    """P crashes after MD has taken a first part of its KV: MD gives up on the request and
    its error names P, so the router re-dispatches without P rather than without MD."""
    prompt = vdp.prompts(1, seed=56, lo=90, hi=91)[0]  # 180 KiB of KV: three line chunks
    link = vdp.cluster["md"].link
    link.set_rate(5e-4)  # one 64 KiB chunk a second
    before = link.stats().forward.bytes
    plan = vdp.cluster.plan("c-p-0", prompt, "P-MD", vdp.sampling(0, MAX_TOKENS))
    run = asyncio.create_task(vdp.run_all([plan]))
    while link.stats().forward.bytes < before + 64 * 1024:  # virtual time: free
        await asyncio.sleep(0.05)
    vdp.cluster.crash("p")
    with pytest.raises(UpstreamError) as failed:
        await run
    assert failed.value.failed == ("p",)
    assert "KV transfer from p failed" in failed.value.message
    await vdp.assert_quiescent()
