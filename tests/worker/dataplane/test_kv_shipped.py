"""P's report that MD imported the KV, timed at P: the router's goodput sample.

In-process P, RLD and MD on a virtual clock, the line to MD slowed so the transfer's
time is the line's: P reports once per request, relayed or not, the KV bytes it sent
and seconds that hold the line's serialization of them (and no prefill).
"""

from __future__ import annotations

import pytest

from pdd.common.wire import KVShipment
from pdd.router.stream_relay import relay_tokens
from pdd.router.token_stream import TokenStreamMerger

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

GBPS = 0.005  # 90 tokens of KV (184 KB) take 0.3 s
#: 0.6 s of relay decoding at the harness's step time: the relayed request is still
#: streaming when MD imports its KV (a shorter one ends first, and its report is unread).
MAX_TOKENS = 120


@pytest.mark.parametrize("pipeline", ["P-MD", "P-RLD-MD"])
async def test_p_reports_the_kv_md_imported_and_the_lines_time(vdp, pipeline) -> None:
    prompt = vdp.prompts(1, seed=71, lo=90, hi=91)[0]
    vdp.cluster["md"].link.set_rate(GBPS)
    plan = vdp.cluster.plan(f"ship-{pipeline}", prompt, pipeline, vdp.sampling(0, MAX_TOKENS))
    shipped: list[KVShipment] = []
    client = vdp.cluster.client()
    try:
        events = relay_tokens(
            plan, client, 120.0, TokenStreamMerger(plan.request_id), on_kv_shipped=shipped.append
        )
        assert len([e async for e in events]) == MAX_TOKENS
    finally:
        await client.aclose()
    [shipment] = shipped
    assert shipment.kv_bytes == len(prompt) * vdp.kv_bytes_per_token  # MD held nothing
    serialization_s = shipment.kv_bytes * 8 / (GBPS * 1e9)
    assert serialization_s <= shipment.seconds < 2 * serialization_s
    await vdp.assert_quiescent()
