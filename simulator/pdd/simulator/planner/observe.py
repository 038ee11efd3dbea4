"""One interval's :class:`ObservedLoad` from a simulated deployment: the requests that
arrived in it and the queue waits that ended in it, what the live planner reads from the
router's and workers' metrics."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdd.common.vocabulary import Pipeline
from pdd.simulator.cluster import Cluster
from pdd.simulator.decode import DecodeInstance
from pdd.simulator.lifecycle import RequestRecord
from pdd.simulator.planner.load import ObservedLoad
from pdd.simulator.prefill import PrefillInstance
from pdd.simulator.stats import percentile

_RELAYED = {Pipeline.P_RLD_MD.value, Pipeline.P_RLD.value}


def window_records(records: Sequence[RequestRecord], start: float, end: float) -> list:
    """Records arriving in [start, end), scanning back from the newest (records are
    appended in arrival order)."""
    out = []
    for r in reversed(records):
        if r.arrival < start:
            break
        if r.arrival < end:
            out.append(r)
    return out


def client_ttft(r: RequestRecord, now: float) -> float:
    """TTFT as the client sees it, queue and refusals included; unanswered: so far."""
    return r.ttft if not math.isnan(r.first_token) else now - r.arrival


def queue_p90(pool: Sequence[PrefillInstance | DecodeInstance], start: float, end: float) -> float:
    """P90 of the queue waits that ended in [start, end) on the pool's live instances (the
    scrape's ``pdd_worker_request_queue_time_seconds`` increase); NaN when none did."""
    waits = [w for inst in pool for w in inst.stats.queue_waits.ended_in(start, end)]
    p90 = percentile(waits, 90)
    return math.nan if p90 is None else p90


def observe(
    cluster: Cluster, records: Sequence[RequestRecord], now: float, interval_s: float
) -> ObservedLoad:
    rs = window_records(records, now - interval_s, now)
    tokens = sum(r.input_tokens for r in rs)
    routed = [r for r in rs if r.pipeline]
    finished = [r for r in rs if not math.isnan(r.finish) and r.output_tokens > 1]
    ttft = percentile([client_ttft(r, now) for r in rs], 90)
    itl = percentile([r.tpot for r in finished], 90)
    return ObservedLoad(
        rate_rps=len(rs) / interval_s,
        input_tokens_mean=tokens / len(rs) if rs else 0.0,
        output_tokens_mean=sum(r.output_tokens for r in rs) / len(rs) if rs else 0.0,
        p_hit=sum(r.p_hit_tokens for r in rs) / tokens if tokens else 0.0,
        md_hit=sum(r.md_hit_tokens for r in rs) / tokens if tokens else 0.0,
        relay_share=sum(r.pipeline in _RELAYED for r in routed) / len(routed) if routed else 0.0,
        prefill_queue_p90_s=queue_p90(cluster.prefill, now - interval_s, now),
        main_queue_p90_s=queue_p90(cluster.main, now - interval_s, now),
        ttft_p90_s=math.nan if ttft is None else ttft,
        itl_p90_s=math.nan if itl is None else itl,
        wan_gbps=cluster.scenario.wan.gbps if cluster.wan else math.nan,
    )
