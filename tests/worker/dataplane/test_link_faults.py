"""Faults of the links between workers: every request still ends cleanly, on every role.

In-process on a virtual clock, so each fault lands exactly where the test puts it
and every timeout fires at its due time, whatever the machine. Each test checks
the client's stream (complete and equal to mono, or a clear error), the byte or
failure counters that say which path broke, and that no survivor holds request
state, a lock or a block afterwards. Process deaths are in ``test_process_faults``.
"""

from __future__ import annotations

import asyncio

import pytest

from pdd.router.errors import UpstreamError
from pdd.worker.roles.protocol import FLAG_FINAL
from pdd.worker.transport import Channel, MsgType

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

TRICKLE_GBPS = 1e-5  # 10 kbit/s: a prompt's KV stays in flight for minutes
MAX_TOKENS = 40
TRANSFER_TIMEOUT_S = 5.0  # the vdp fixture's workers' (conftest)
LONG_TOKENS = 120  # 0.6 s of relay decoding at the harness's step time


async def test_wan_cut_ends_transfers_and_relay_finishes(vdp) -> None:
    """The line to MD is cut while its KV is in flight: the relay carries the request."""
    prompt = vdp.prompts(1, seed=53, lo=90, hi=91)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "f-cut")
    link = vdp.cluster["md"].link
    link.set_rate(TRICKLE_GBPS)
    delta = vdp.counters("p")

    def cut(event) -> None:
        link.partition(True)  # stalls, then resets after the grace period

    plan = vdp.cluster.plan("f-cut-0", prompt, "P-RLD-MD", vdp.sampling(0, MAX_TOKENS))
    [result] = await vdp.run_all([plan], on_token=cut)
    assert result.token_ids == expected[0]
    assert result.duplicates == 0 and set(result.sources) == {"rld"}
    await vdp.assert_quiescent()  # P's transfer and MD's attached request ended
    assert delta("p", "pdd_worker_transfer_failures", 'path="wan"') == 1


async def test_wan_cut_without_relay_fails_the_request_at_once_naming_md(vdp) -> None:
    """P cannot reach MD and says so on its stream: the request fails now, blaming MD (for
    the router's retry), not when MD's transfer timeout says the request never came."""
    prompt = vdp.prompts(1, seed=54, lo=90, hi=91)[0]
    vdp.cluster["md"].link.partition(True)
    plan = vdp.cluster.plan("f-cut-pmd", prompt, "P-MD", vdp.sampling(0, MAX_TOKENS))
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(UpstreamError, match="p could not send the KV to md") as caught:
        await vdp.run_all([plan])
    assert "(unreachable)" in caught.value.message and caught.value.failed == ("md",)
    assert loop.time() - start < TRANSFER_TIMEOUT_S  # MD's arrival timeout did not fire
    await vdp.assert_quiescent()


async def test_a_silent_line_is_reported_by_p_within_its_connect_timeout(
    vdp_default_timeouts,
) -> None:
    """A line that drops everything (no refusal, no reset): P's handshake with MD gets no
    answer and P reports it after its connect timeout (10 s), long before MD's transfer
    timeout (30 s) would tell the router that the request never reached MD."""
    vdp = vdp_default_timeouts
    settings = vdp.cluster["p"].instance.settings
    connect_s, transfer_s = settings.transport.connect_timeout_s, settings.transfer_timeout_s
    assert connect_s < transfer_s
    prompt = vdp.prompts(1, seed=59, lo=90, hi=91)[0]
    path = vdp.cluster.wan_path("md")
    path.pause()
    plan = vdp.cluster.plan("f-silent-pmd", prompt, "P-MD", vdp.sampling(0, MAX_TOKENS))
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(UpstreamError, match="p could not send the KV to md") as caught:
        await vdp.run_all([plan])
    took = loop.time() - start
    assert "timed out" in caught.value.message and caught.value.failed == ("md",)
    assert connect_s <= took < connect_s + 1.0  # P's connect timeout fired, not MD's
    path.resume()
    await vdp.assert_quiescent()


async def test_stalled_wan_times_out_on_both_ends_and_relay_finishes(vdp) -> None:
    """The path to MD stops moving bytes (no reset): both ends give up after their timeout."""
    prompt = vdp.prompts(1, seed=55, lo=90, hi=91)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "f-stall")
    vdp.cluster["md"].link.set_rate(TRICKLE_GBPS)
    path = vdp.cluster.wan_path("md")
    delta = vdp.counters("p", "md")
    plan = vdp.cluster.plan("f-stall-0", prompt, "P-RLD-MD", vdp.sampling(0, MAX_TOKENS))
    [result] = await vdp.run_all([plan], on_token=lambda event: path.pause())
    assert result.token_ids == expected[0] and set(result.sources) == {"rld"}
    await vdp.assert_quiescent()
    assert delta("p", "pdd_worker_transfer_failures", 'path="wan"') == 1
    assert delta("md", "pdd_worker_prefix_hit_tokens") == 0  # MD took nothing from this request


async def test_lossy_slow_wan_changes_nothing_but_time(vdp) -> None:
    """Loss (resends) and a long delay on the WAN: same tokens, same bytes, handoffs done."""
    prompts = vdp.prompts(3, seed=56)
    # Every resend stalls its connection 50 ms: the handoffs come after 40-80 tokens.
    expected = await vdp.reference(prompts, LONG_TOKENS, "f-loss")
    path = vdp.cluster.wan_path("md")
    path.delay_s, path.loss, path.retransmit_s = 0.01, 0.2, 0.05
    rld_path = vdp.cluster.wan_path("rld")
    rld_path.delay_s, rld_path.loss, rld_path.retransmit_s = 0.01, 0.2, 0.05
    delta = vdp.counters("p", "rld", "md")
    plans = [
        vdp.cluster.plan(
            f"f-loss-{i}", p, "P-RLD-MD", vdp.sampling(i, LONG_TOKENS), handoff="one-shot"
        )
        for i, p in enumerate(prompts)
    ]
    results = await vdp.run_all(plans)
    assert [r.token_ids for r in results] == expected
    assert all(r.duplicates == 0 and r.sources[-1] == "md" for r in results)
    md_miss = delta("md", "pdd_worker_prompt_tokens") - delta("md", "pdd_worker_prefix_hit_tokens")
    assert delta("p", "pdd_worker_wan_kv_bytes") == md_miss * vdp.kv_bytes_per_token
    assert delta("rld", "pdd_worker_handoffs") == len(plans)
    assert delta("p", "pdd_worker_transfer_failures") == 0
    await vdp.assert_quiescent()


async def test_relay_never_gets_its_kv_and_main_decode_streams_it_all(vdp) -> None:
    """The fast path to RLD is cut: the router hands MD the (no) tokens the client has."""
    prompt = vdp.prompts(1, seed=57, lo=90, hi=91)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "f-fast")
    vdp.cluster.fast_path("rld").cut()
    delta = vdp.counters("p")
    plan = vdp.cluster.plan("f-fast-0", prompt, "P-RLD-MD", vdp.sampling(0, MAX_TOKENS))
    [result] = await vdp.run_all([plan])
    assert result.token_ids == expected[0]
    assert set(result.sources) == {"md"} and result.duplicates == 0
    assert delta("p", "pdd_worker_transfer_failures", 'path="fast"') == 1
    await vdp.assert_quiescent()


async def test_wan_cut_during_the_handoff_still_gives_monos_tokens(vdp) -> None:
    """MD's KV lands while the line back to RLD is cut, so MD cannot take the token IDs
    from the relay: the relay keeps the request to the end, every position once, and MD
    lets go of what it received."""
    prompt = vdp.prompts(1, seed=58, lo=90, hi=91)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "f-handoff")
    to_md, to_rld = vdp.cluster.wan_path("md"), vdp.cluster.wan_path("rld")
    to_md.pause()  # MD has no KV until the relay has streamed a few tokens

    def cut_then_land(event) -> None:
        if event.seq == 4:
            to_rld.cut()
            to_md.resume()

    plan = vdp.cluster.plan("f-handoff-0", prompt, "P-RLD-MD", vdp.sampling(0, MAX_TOKENS))
    [result] = await vdp.run_all([plan], on_token=cut_then_land)
    to_rld.heal()
    assert result.token_ids == expected[0] and result.duplicates == 0
    assert set(result.sources) == {"rld"}  # MD never got the IDs: the relay kept it all
    await vdp.assert_quiescent()


def cut_once_sent(monkeypatch, path, msg_type: MsgType, final_only: bool = False) -> list[int]:
    """Cut ``path`` the moment a frame of ``msg_type`` has been written to it, so the frame
    is lost on the line (a cut resets the connection and drops what is still queued), as a
    real cut between a send and its delivery. Returns the flags of the frames cut after."""
    send, cut_after = Channel.send, []

    async def send_then_cut(self, kind, request_id, payload=b"", flags=0) -> None:
        await send(self, kind, request_id, payload, flags)
        if kind == msg_type and not cut_after and (flags & FLAG_FINAL or not final_only):
            cut_after.append(flags)
            path.cut()

    monkeypatch.setattr(Channel, "send", send_then_cut)
    return cut_after


async def handoff_under_cut(vdp, monkeypatch, tag: str, msg_type: MsgType, final_only: bool):
    """A P-RLD-MD request whose handoff exchange is cut after ``msg_type`` left its sender."""
    prompt = vdp.prompts(1, seed=59, lo=90, hi=91)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, tag)
    to_md, to_rld = vdp.cluster.wan_path("md"), vdp.cluster.wan_path("rld")
    to_md.pause()  # MD has no KV until the relay has streamed a few tokens
    cut_after = cut_once_sent(monkeypatch, to_rld, msg_type, final_only)

    def land(event) -> None:
        if event.seq == 4:
            to_md.resume()

    plan = vdp.cluster.plan(f"{tag}-0", prompt, "P-RLD-MD", vdp.sampling(0, MAX_TOKENS))
    [result] = await vdp.run_all([plan], on_token=land)
    to_rld.heal()
    assert cut_after, f"the handoff never sent a {msg_type.name} frame"
    assert result.token_ids == expected[0]  # every position once, mono's token at each
    assert [e.seq for e in result.tokens] == list(range(MAX_TOKENS))
    await vdp.assert_quiescent()
    return result


async def test_wan_cut_after_the_relay_sent_its_final_ids(vdp, monkeypatch) -> None:
    """The relay's last IDs are lost on the line: the relay never hears MD's ack, so it
    streams on to the end; MD, left without the IDs, waits for the router's copy, gives
    up after its transfer timeout and lets go of the request (quiescent afterwards)."""
    result = await handoff_under_cut(vdp, monkeypatch, "f-lost-ids", MsgType.TOKEN_IDS, True)
    assert set(result.sources) == {"rld"} and result.duplicates == 0  # MD streamed nothing


async def test_wan_cut_after_main_decode_acknowledged(vdp, monkeypatch) -> None:
    """MD took the IDs and acknowledged, but the ack is lost: both MD (the handoff is
    done for it) and the relay (no ack: it streams on) produce the positions after the
    handoff point; the router's merger passes each position once, equal to mono's."""
    result = await handoff_under_cut(vdp, monkeypatch, "f-lost-ack", MsgType.ACK, False)
    assert "rld" in result.sources  # the relay streamed before the handoff point
    assert result.duplicates > 0  # MD streamed after it too: the ack's loss made two sources
