"""Every WAN channel end exports its links: P's KV sender and MD's receiver, both handoff ends.

In-process on a virtual clock behind the harness's WAN line (``LINK``): the RTT each end
reads is the line's delay (plus at most its jitter each way), the goodput never exceeds
the line's rate, and the in-datacenter path (P -> RLD) exports no WAN series at all.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

LINE_RTT_S = 0.004  # conftest.LINK: 4 ms round trip, 1 ms jitter each way
LINE_JITTER_S = 0.001
LINE_BPS = 1e9 / 8  # conftest.LINK: 1 Gbit/s


def link(src: str, dst: str, src_pool: str, dst_pool: str) -> str:
    """The label set of a link as ``flatten`` writes it (sorted)."""
    return f'{{dst="{dst}",dst_pool="{dst_pool}",src="{src}",src_pool="{src_pool}"}}'


P_MD = link("p", "md", "prefill", "main")
RLD_MD = link("rld", "md", "relay", "main")


def wan_series(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("pdd_worker_wan_") and "{" in k}


async def test_each_wan_end_exports_its_links_and_the_fast_path_none(vdp) -> None:
    prompt = vdp.prompts(1, seed=71, lo=90, hi=91)[0]
    plan = vdp.cluster.plan("wm-0", prompt, "P-RLD-MD", vdp.sampling(0, 40), handoff="one-shot")
    [result] = await vdp.run_all([plan])
    assert "md" in result.sources  # the handoff happened: MD <-> RLD carried token IDs
    await vdp.assert_quiescent()
    p, md, rld = (wan_series(vdp.cluster[n].metrics()) for n in ("p", "md", "rld"))

    # P's sender and MD's receiver both measured P -> MD.
    for end in (p, md):
        assert 0 < end[f"pdd_worker_wan_goodput_bytes_per_second{P_MD}"] <= LINE_BPS
        rtt = end[f"pdd_worker_wan_rtt_min_seconds{P_MD}"]
        assert LINE_RTT_S <= rtt <= LINE_RTT_S + 2 * LINE_JITTER_S
        assert end[f"pdd_worker_wan_rtt_seconds{P_MD}"] >= LINE_RTT_S
        assert end[f"pdd_worker_wan_transfer_timeouts_total{P_MD}"] == 0
    # The transfer is over: nothing queued or in flight is left on the link.
    assert p[f"pdd_worker_wan_queued_bytes{P_MD}"] == 0
    assert p[f"pdd_worker_wan_in_flight_bytes{P_MD}"] == 0
    # Both handoff ends measured RLD -> MD (MD dialled, RLD sent the IDs).
    for end in (md, rld):
        assert end[f"pdd_worker_wan_goodput_bytes_per_second{RLD_MD}"] > 0
        assert end[f"pdd_worker_wan_rtt_min_seconds{RLD_MD}"] >= LINE_RTT_S
    # Nothing failed, and P -> RLD (the fast path) is no WAN link.
    assert not any("failures" in k for end in (p, md, rld) for k in end)
    assert not any('dst="rld",dst_pool="relay",src="p"' in k for k in p)


async def test_a_stalled_line_is_one_timeout_at_each_end_and_leaves_no_backlog(vdp) -> None:
    """The line to MD stops moving bytes mid-KV: P's wait for MD and MD's wait for the KV
    each time out once, on P -> MD, and P's backlog leaves the link with the channel."""
    prompt = vdp.prompts(1, seed=72, lo=90, hi=91)[0]
    miss = len(prompt) * vdp.kv_bytes_per_token  # MD holds nothing of it
    vdp.cluster["md"].link.set_rate(1e-3)  # 1 Mbit/s: the KV takes 1.5 s to cross
    path = vdp.cluster.wan_path("md")
    plan = vdp.cluster.plan("wm-stall", prompt, "P-RLD-MD", vdp.sampling(0, 40))
    backlog_at_stall: list[float] = []

    def stall_once_the_kv_is_on_the_link(event) -> None:
        p = wan_series(vdp.cluster["p"].metrics())
        backlog = p.get(f"pdd_worker_wan_queued_bytes{P_MD}", 0) + p.get(
            f"pdd_worker_wan_in_flight_bytes{P_MD}", 0
        )
        if backlog >= miss and not backlog_at_stall:
            backlog_at_stall.append(backlog)
            path.pause()

    [result] = await vdp.run_all([plan], on_token=stall_once_the_kv_is_on_the_link)
    assert set(result.sources) == {"rld"}  # the relay carried the request
    # P's sender showed the KV it owed MD (committed and not yet sent, or not yet confirmed),
    # and the line stalled while it did.
    assert backlog_at_stall
    await vdp.assert_quiescent()
    p, md = (wan_series(vdp.cluster[n].metrics()) for n in ("p", "md"))
    assert p[f"pdd_worker_wan_transfer_timeouts_total{P_MD}"] == 1
    assert md[f"pdd_worker_wan_transfer_timeouts_total{P_MD}"] == 1
    assert p[f"pdd_worker_wan_queued_bytes{P_MD}"] == 0
    assert p[f"pdd_worker_wan_in_flight_bytes{P_MD}"] == 0
