"""KV streamed while P prefills: each prefill chunk's KV crosses as its step ends.

In-process on a virtual clock. The engines prefill in ``PREFILL_CHUNK_TOKENS`` (32)
token chunks (conftest), so a 200-token prompt takes seven steps at P: the tests
watch KV on the line while P's engine still computes the prompt, and put faults
there (the line cut, MD refusing the rest) to check they end as the fault matrix's
other cells do: the relay carries the request, or a clean error, nothing held.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pdd.router.errors import UpstreamError
from pdd.testing.waiting import until
from pdd.worker.engine.request import UnknownRequestError

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

MAX_TOKENS = 24
PROMPT_TOKENS = 200  # seven 32-token prefill steps
KV_BYTES_PER_TOKEN = 2048  # the tiny model's (conftest)
POLL_S = 0.001  # a fifth of an engine step (STEP_S 5 ms): sees each step's state


def written(vdp, worker: str, request_id: str) -> int:
    """Prompt tokens whose KV ``worker``'s engine has computed for the request."""
    return vdp.cluster[worker].role.runner.engine.computed_tokens(request_id)


async def kv_on_line_mid_prefill(vdp, request_id: str) -> int:
    """Wait for P's first KV bytes on the WAN; how much of the prompt P had written then."""
    sent = vdp.counters("p")

    def seen() -> int | None:
        if sent("p", "pdd_worker_wan_kv_bytes") == 0:
            return None
        return written(vdp, "p", request_id) + 1  # + 1: truthy even at 0

    return await until(seen, "P's first KV on the WAN", every_s=POLL_S) - 1


async def test_kv_crosses_the_wan_while_p_still_prefills(vdp) -> None:
    """P-MD: KV is on the line before P's prefill has written the whole prompt, and MD
    decodes mono's tokens from what arrived."""
    prompt = vdp.prompts(1, seed=81, lo=PROMPT_TOKENS, hi=PROMPT_TOKENS + 1)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "st")
    plan = vdp.cluster.plan("st-0", prompt, "P-MD", vdp.sampling(0, MAX_TOKENS))
    sent = vdp.counters("p")
    run = asyncio.ensure_future(vdp.run_all([plan]))
    at_first_bytes = await kv_on_line_mid_prefill(vdp, "st-0")
    assert 0 < at_first_bytes < len(prompt)  # streamed, not shipped after the prefill
    [result] = await run
    assert result.token_ids == expected[0] and set(result.sources) == {"md"}
    # each token once
    assert sent("p", "pdd_worker_wan_kv_bytes") == len(prompt) * KV_BYTES_PER_TOKEN
    await vdp.assert_quiescent()


async def first_writes(vdp, request_id: str, count: int) -> list[int]:
    """The first ``count`` amounts of the prompt P's engine had written, step by step."""
    seen: list[int] = []

    def enough() -> bool:
        with contextlib.suppress(UnknownRequestError):  # not added yet
            now = written(vdp, "p", request_id)
            if now and (not seen or seen[-1] != now):
                seen.append(now)
        return len(seen) >= count

    await until(enough, f"P's first {count} prefill steps", every_s=POLL_S)
    return seen


@pytest.mark.parametrize(
    ("pipeline", "predicted", "steps"),
    [("P-MD", 0, [4, 36]), ("P-MD", 40, [32, 44]), ("P-RLD-MD", 0, [32, 64])],
    ids=["p-md", "p-md-predicted-hit", "relayed"],
)
async def test_p_md_puts_the_first_kv_md_lacks_on_the_line_after_a_short_step(
    vdp, pipeline: str, predicted: int, steps: list[int]
) -> None:
    """On P-MD a prefill chunk ends an eighth of the step budget (32 / 8 = 4 tokens) past
    MD's predicted hit (``chunk_break``), so the KV MD lacks starts crossing after a short
    step; the others are whole. Where a relay serves the first token the prefill is not
    cut. Either way MD decodes mono's tokens."""
    prompt = vdp.prompts(1, seed=84, lo=PROMPT_TOKENS, hi=PROMPT_TOKENS + 1)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "fs")
    plan = vdp.cluster.plan(
        "fs-0", prompt, pipeline, vdp.sampling(0, MAX_TOKENS), main_hit_tokens=predicted
    )
    run = asyncio.ensure_future(vdp.run_all([plan]))
    assert await first_writes(vdp, "fs-0", 2) == steps
    [result] = await run
    assert result.token_ids == expected[0]
    await vdp.assert_quiescent()


async def test_wan_cut_mid_prefill_relay_carries_the_request(vdp) -> None:
    """The line to MD is cut while P still prefills and part of the KV has crossed: P's
    transfer ends, MD lets go of what it took, the relay serves mono's tokens."""
    prompt = vdp.prompts(1, seed=82, lo=PROMPT_TOKENS, hi=PROMPT_TOKENS + 1)[0]
    expected = await vdp.reference([prompt], MAX_TOKENS, "st-cut")
    delta = vdp.counters("p")
    plan = vdp.cluster.plan("st-cut-0", prompt, "P-RLD-MD", vdp.sampling(0, MAX_TOKENS))
    run = asyncio.ensure_future(vdp.run_all([plan]))
    at_cut = await kv_on_line_mid_prefill(vdp, "st-cut-0")
    vdp.cluster["md"].link.partition(True)  # stalls, then resets after the grace period
    assert at_cut < len(prompt)
    [result] = await run
    assert result.token_ids == expected[0]
    assert result.duplicates == 0 and set(result.sources) == {"rld"}
    await vdp.assert_quiescent()
    assert delta("p", "pdd_worker_transfer_failures", 'path="wan"') == 1
    assert delta("p", "pdd_worker_transfer_failures", 'path="fast"') == 0


async def test_wan_cut_mid_prefill_without_relay_is_reported_by_p(vdp) -> None:
    """P-MD, the line cut mid-prefill: P says on its stream that its KV cannot reach MD
    (naming MD, for the router's retry), and nothing is left held anywhere."""
    prompt = vdp.prompts(1, seed=83, lo=PROMPT_TOKENS, hi=PROMPT_TOKENS + 1)[0]
    plan = vdp.cluster.plan("st-cut-pmd", prompt, "P-MD", vdp.sampling(0, MAX_TOKENS))
    run = asyncio.ensure_future(vdp.run_all([plan]))
    await kv_on_line_mid_prefill(vdp, "st-cut-pmd")
    vdp.cluster["md"].link.partition(True)
    with pytest.raises(UpstreamError) as caught:
        await run
    assert "md" in caught.value.failed
    vdp.cluster["md"].link.partition(False)
    await vdp.assert_quiescent()


async def test_main_decode_refusing_mid_prefill_stops_the_stream(vdp) -> None:
    """MD drops the request after taking P's first chunks (a cancel there): it refuses the
    next chunk and ends the client's stream with its error; P stops streaming the rest of
    its prefill into the refusal (fewer bytes than the prompt's KV cross), and nothing
    leaks."""
    prompt = vdp.prompts(1, seed=84, lo=PROMPT_TOKENS, hi=PROMPT_TOKENS + 1)[0]
    delta = vdp.counters("p")
    plan = vdp.cluster.plan("st-refused", prompt, "P-MD", vdp.sampling(0, MAX_TOKENS))
    run = asyncio.ensure_future(vdp.run_all([plan]))
    await kv_on_line_mid_prefill(vdp, "st-refused")
    await vdp.cluster["md"].role.cancel("st-refused")
    with pytest.raises(UpstreamError):
        await run
    await vdp.assert_quiescent()
    assert delta("p", "pdd_worker_wan_kv_bytes") < len(prompt) * KV_BYTES_PER_TOKEN
