"""Handoffs after RLD ran past the catch-up threshold, the mode policy, and the DRC.

In-process on a virtual clock (deterministic). The WAN path to MD is held closed
until every request has streamed more than the default threshold (64) from RLD,
then released: MD's KV arrives late, exactly the case PDD's relay exists for.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdd.common.handoff import choose_handoff_mode
from pdd.common.wire import BlockStored, CacheEventsPage, TokenEvent
from pdd.testing.waiting import until

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

THRESHOLD = 64  # the plan's default catch-up threshold
#: Well past what RLD decodes between the release and the handoff (about ten more tokens).
MAX_TOKENS = 120


async def test_late_kv_handoff_in_both_modes_matches_mono(vdp) -> None:
    prompts = vdp.prompts(4, seed=21, lo=60, hi=100)
    expected = await vdp.reference(prompts, MAX_TOKENS, "late")
    modes = ["catch-up", "one-shot", "catch-up", "one-shot"]
    plans = [
        vdp.cluster.plan(f"late-{i}", p, "P-RLD-MD", vdp.sampling(i, MAX_TOKENS), handoff=m)
        for i, (p, m) in enumerate(zip(prompts, modes, strict=True))
    ]
    path = vdp.cluster.wan_path("md")
    delta = vdp.counters("rld", "md")
    streamed: dict[str, int] = {}

    def release_once_every_relay_is_past_the_threshold(event: TokenEvent) -> None:
        streamed[event.request_id] = event.seq
        if len(streamed) == len(plans) and min(streamed.values()) > THRESHOLD:
            path.resume()

    path.pause()
    results = await vdp.run_all(plans, on_token=release_once_every_relay_is_past_the_threshold)

    assert [r.token_ids for r in results] == expected
    assert all(r.duplicates == 0 for r in results)
    for r in results:  # RLD streamed the start, MD the end
        assert r.sources[0] == "rld" and r.sources[-1] == "md"
        assert r.sources.index("md") > THRESHOLD
    assert delta("rld", "pdd_worker_handoffs", 'mode="catch-up"') == 2
    assert delta("rld", "pdd_worker_handoffs", 'mode="one-shot"') == 2
    assert delta("rld", "pdd_worker_handoff_tokens") > 4 * THRESHOLD
    await vdp.assert_quiescent()


async def test_handoff_carries_token_ids_not_kv(vdp) -> None:
    """One-shot handoffs: 4 bytes per token plus an 8-byte header per reply, on the wire too."""
    prompts = vdp.prompts(10, seed=11)
    expected = await vdp.reference(prompts, 48, "ids-ref")
    link, path = vdp.cluster["rld"].link, vdp.cluster.wan_path("md")
    before = link.stats()
    delta = vdp.counters("rld", "md")
    plans = [
        vdp.cluster.plan(f"ids-{i}", p, "P-RLD-MD", vdp.sampling(i, 48), handoff="one-shot")
        for i, p in enumerate(prompts)
    ]
    streamed: dict[str, int] = {}

    def release_once_every_relay_streamed_a_few(event: TokenEvent) -> None:
        streamed[event.request_id] = event.seq
        if len(streamed) == len(plans) and min(streamed.values()) >= 8:
            path.resume()

    path.pause()  # every request is handed over, none finishes on the relay
    results = await vdp.run_all(plans, on_token=release_once_every_relay_streamed_a_few)
    assert [r.token_ids for r in results] == expected

    handoffs = delta("rld", "pdd_worker_handoffs")
    tokens = delta("rld", "pdd_worker_handoff_tokens")
    payload = delta("rld", "pdd_worker_handoff_bytes")
    assert handoffs == delta("rld", "pdd_worker_handoffs", 'mode="one-shot"') == len(plans)
    assert tokens == sum(r.sources.count("rld") for r in results) - len(plans)  # but the first
    headers, rest = divmod(payload - 4 * tokens, 8)
    assert rest == 0 and headers == len(plans)  # one 8-byte header per (single) reply
    # Everything RLD sent back across the WAN (ids, framing, handshakes) is far below the KV
    # of the tokens it handed over.
    sent_back = link.stats().reverse.bytes - before.reverse.bytes
    assert sent_back < payload + 2048 * len(plans)
    assert sent_back < tokens * vdp.kv_bytes_per_token
    await vdp.assert_quiescent()


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


async def test_second_turn_hits_main_decode_radix_cache(vdp) -> None:
    """Turn 2 = turn 1's prompt + answer + a new message: only the new part crosses the WAN."""
    turn1 = vdp.prompts(6, seed=31, lo=50, hi=90)
    out1 = await vdp.reference(turn1, 24, "mt1")
    plans1 = [
        vdp.cluster.plan(f"mt1-{i}", p, "P-MD" if i % 2 else "P-RLD-MD", vdp.sampling(i, 24))
        for i, p in enumerate(turn1)
    ]
    assert [r.token_ids for r in await vdp.run_all(plans1)] == out1

    new_msgs = vdp.prompts(6, seed=32, lo=10, hi=30)
    turn2 = [p + o + m for p, o, m in zip(turn1, out1, new_msgs, strict=True)]
    expected = await vdp.reference(turn2, 8, "mt2")
    delta = vdp.counters("p", "md")
    plans2 = [
        vdp.cluster.plan(f"mt2-{i}", p, "P-RLD-MD", vdp.sampling(i, 8)) for i, p in enumerate(turn2)
    ]
    assert [r.token_ids for r in await vdp.run_all(plans2)] == expected

    bs = vdp.block_size
    # MD cached each turn-1 prompt and (where it decoded to the end) the answer too.
    least_hit = sum(len(p) // bs * bs for p in turn1)
    hit = delta("md", "pdd_worker_prefix_hit_tokens")
    assert hit >= least_hit
    miss = sum(len(p) for p in turn2) - hit
    assert delta("p", "pdd_worker_wan_kv_bytes") == miss * vdp.kv_bytes_per_token
    await vdp.assert_quiescent()


async def test_p_md_caches_the_whole_conversation(vdp) -> None:
    """Without a relay MD decodes everything: turn 2 hits every full block of turn 1."""
    prompt = vdp.prompts(1, seed=41, lo=70, hi=71)[0]
    out = await vdp.reference([prompt], 30, "pmd1")
    await vdp.run_all([vdp.cluster.plan("pmd1-0", prompt, "P-MD", vdp.sampling(0, 30))])
    turn2 = prompt + out[0] + [7, 8, 9]
    delta = vdp.counters("md")
    await vdp.run_all([vdp.cluster.plan("pmd2-0", turn2, "P-MD", vdp.sampling(0, 4))])
    computed = len(prompt) + len(out[0]) - 1  # the last sampled token has no KV yet
    assert (
        delta("md", "pdd_worker_prefix_hit_tokens") == computed // vdp.block_size * vdp.block_size
    )
    await vdp.assert_quiescent()


async def test_md_caches_the_answer_of_a_request_the_relay_finished(vdp) -> None:
    """The relay finishes turn 1 while MD's KV is held on the line: MD computes the answer
    from the relay's IDs, so turn 2 hits the whole conversation there, as after P-MD, and
    only the new message's KV crosses the WAN."""
    prompt = vdp.prompts(1, seed=43, lo=70, hi=71)[0]
    out = await vdp.reference([prompt], 30, "rf1")
    path = vdp.cluster.wan_path("md")

    def release_once_the_relay_finished(event: TokenEvent) -> None:
        if event.finished:
            path.resume()

    path.pause()
    delta = vdp.counters("rld")
    plan = vdp.cluster.plan("rf1-0", prompt, "P-RLD-MD", vdp.sampling(0, 30), handoff="one-shot")
    (turn1,) = await vdp.run_all([plan], on_token=release_once_the_relay_finished)
    assert turn1.token_ids == out[0] and set(turn1.sources) == {"rld"}
    assert (
        delta("rld", "pdd_worker_handoffs") == 0
    )  # nothing was handed over: the relay finished it
    await vdp.assert_quiescent()  # MD has taken the KV, asked the relay and computed

    turn2 = prompt + out[0] + [7, 8, 9]
    delta = vdp.counters("p", "md")
    await vdp.run_all([vdp.cluster.plan("rf2-0", turn2, "P-MD", vdp.sampling(0, 4))])
    bs = vdp.block_size
    hit = delta("md", "pdd_worker_prefix_hit_tokens")
    assert hit == (len(prompt) + len(out[0])) // bs * bs > len(prompt)
    assert delta("p", "pdd_worker_wan_kv_bytes") == (len(turn2) - hit) * vdp.kv_bytes_per_token
    await vdp.assert_quiescent()


async def test_a_next_turn_waits_for_the_answer_md_is_computing(vdp) -> None:
    """Turn 2 reaches MD while MD still learns turn 1's answer from the relay that
    finished it. P sends only what the router predicts MD lacks (the new message): MD
    waits for turn 1 to land before it attaches, so nothing is sent twice."""
    prompt = vdp.prompts(1, seed=44, lo=70, hi=71)[0]
    out = await vdp.reference([prompt], 30, "lw1")
    turn2 = prompt + out[0] + [7, 8, 9]
    expected = await vdp.reference([turn2], 4, "lw2")
    to_md, to_relay = vdp.cluster.wan_path("md"), vdp.cluster.wan_path("rld")
    md = vdp.cluster["md"].role
    bs = vdp.block_size

    def release_once_the_relay_finished(event: TokenEvent) -> None:
        if event.finished:
            to_md.resume()

    to_md.pause()
    to_relay.pause()  # MD's question to the relay (which IDs?) waits on the line
    plan1 = vdp.cluster.plan("lw1-0", prompt, "P-RLD-MD", vdp.sampling(0, 30), handoff="one-shot")
    (turn1,) = await vdp.run_all([plan1], on_token=release_once_the_relay_finished)
    assert set(turn1.sources) == {"rld"}
    prompt_blocks = len(prompt) // bs * bs
    await until(
        lambda: md.runner.engine.cached_prefix_tokens(turn2) == prompt_blocks,
        "turn 1's prompt landed on MD",
    )

    delta = vdp.counters("p", "md")
    predicted = (len(prompt) + len(out[0])) // bs * bs  # what the router counts as MD's
    plan2 = vdp.cluster.plan("lw2-0", turn2, "P-MD", vdp.sampling(0, 4), main_hit_tokens=predicted)
    turn2_run = asyncio.ensure_future(vdp.run_all([plan2]))
    await until(lambda: "lw2-0" in md.requests, "turn 2 reached MD")
    to_relay.resume()
    (result,) = await turn2_run
    assert result.token_ids == expected[0]
    assert delta("md", "pdd_worker_prefix_hit_tokens") == predicted
    assert (
        delta("p", "pdd_worker_wan_kv_bytes") == (len(turn2) - predicted) * vdp.kv_bytes_per_token
    )
    await vdp.assert_quiescent()


async def test_cache_events_are_published_with_cursors(vdp) -> None:
    await vdp.run_all([vdp.cluster.plan("ev-0", vdp.prompts(1, seed=71)[0], "P-MD")])
    md = vdp.cluster["md"]
    url = f"{md.url}/v1/pdd/cache-events"
    auth = {"Authorization": f"Bearer {vdp.cluster.secret}"}
    async with httpx.AsyncClient(transport=vdp.cluster.http) as http:
        assert (await http.get(url)).status_code == 401

        async def page(since: int) -> CacheEventsPage:
            reply = await http.get(url, params={"since": since}, headers=auth)
            return CacheEventsPage.model_validate(reply.json())

        first = await page(0)
        assert first.instance_id == "md" and not first.reset
        assert any(isinstance(e, BlockStored) for e in first.events)
        assert first.next_cursor >= len(first.events)
        again = await page(first.next_cursor)
        assert again.events == [] or again.next_cursor > first.next_cursor
        assert (await page(first.next_cursor + 10_000)).reset  # a cursor from another life


async def test_sequential_relayed_requests_reuse_channels_to_the_relay(vdp) -> None:
    """P (for the KV) and MD (for the hand-off) keep their channel to RLD after a
    conversation that ended cleanly, and one spare each, so later relayed requests open
    none: RLD accepts four channels in all, however many requests it serves."""
    prompts = vdp.prompts(4, seed=23, lo=60, hi=61)
    expected = await vdp.reference(prompts, 24, "hpool-ref")
    results = []
    for i, prompt in enumerate(prompts):
        plan = vdp.cluster.plan(f"hpool-{i}", prompt, "P-RLD-MD", vdp.sampling(i, 24))
        results += await vdp.run_all([plan])
    assert [r.token_ids for r in results] == expected
    assert all(r.sources[0] == "rld" for r in results)
    assert vdp.channels_accepted("rld") == 4  # P's first and spare, MD's first and spare
    assert vdp.cluster["p"].role.channel_pool.idle("rld") >= 1
    assert vdp.cluster["md"].role.relay_pool.idle("rld") >= 1
    await vdp.assert_quiescent()
