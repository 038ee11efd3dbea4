"""What a run reports: latency percentiles, SLO goodput, cost, WAN use, relay share.

Requests that arrived after the warm-up are scored. A request that never produced a
first token (still queued at the horizon, or refused ``max_retries`` times) counts
as missing the SLO, and its TTFT as "at least until the horizon" so an overloaded
system's percentiles stay honest instead of silently dropping its worst requests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from pdd.simulator.lifecycle import RequestRecord
from pdd.simulator.runner import SystemRun
from pdd.simulator.scenario import BillingSpec, SloSpec
from pdd.simulator.stats import percentile


def scored(run: SystemRun) -> list[RequestRecord]:
    return [r for r in run.records if run.warmup_s <= r.arrival <= run.score_until_s]


def meets_slo(r: RequestRecord, slo: SloSpec) -> bool:
    return not math.isnan(r.finish) and r.ttft <= slo.ttft_s and r.tpot <= slo.tpot_s and not r.lost


def ttft_bounded(r: RequestRecord, horizon: float) -> float:
    return r.ttft if not math.isnan(r.first_token) else horizon - r.arrival


def attainment(run: SystemRun, slo: SloSpec) -> float:
    rs = scored(run)
    return sum(meets_slo(r, slo) for r in rs) / len(rs) if rs else 0.0


def summarize(run: SystemRun, slo: SloSpec, billing: BillingSpec) -> dict:
    """The per-system figures of the report (JSON-ready; seconds, bytes, $/h).

    ``benefit`` is what the requests served within the SLO earn per hour over what the
    hardware costs per hour (cached input billed at its discount: see BillingSpec)."""
    rs = scored(run)
    window = max(1e-9, run.score_until_s - run.warmup_s)
    ttfts = [ttft_bounded(r, run.horizon_s) for r in rs]
    finished = [r for r in rs if not math.isnan(r.finish)]
    tpots = [r.tpot for r in finished if r.output_tokens > 1]
    met_records = [r for r in rs if meets_slo(r, slo)]
    met = len(met_records)
    earned = sum(
        billing.revenue(r.input_tokens, r.p_hit_tokens, r.output_tokens) for r in met_records
    )
    revenue_per_hour = earned / window * 3600
    out_tokens = sum(r.output_tokens for r in finished)
    relayed = [r for r in finished if r.handoff]
    return {
        "requests": len(rs),
        "finished": len(finished),
        "lost": sum(r.lost for r in rs),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
        "ttft_p99": percentile(ttfts, 99),
        "tpot_p50": percentile(tpots, 50),
        "tpot_p99": percentile(tpots, 99),
        "slo_attainment": met / len(rs) if rs else 0.0,
        "slo_goodput_rps": met / window,
        "offered_rps": len(rs) / window,
        "cost_per_hour": run.cost_per_hour,
        "revenue_per_hour": revenue_per_hour,
        "benefit": revenue_per_hour / run.cost_per_hour if run.cost_per_hour else 0.0,
        "rld_token_share": sum(r.rld_tokens for r in finished) / out_tokens if out_tokens else 0.0,
        "wan_gbytes": run.wan_bytes / 1e9,
        "wan_utilization": _wan_utilization(run),
        "p_hit_ratio": _hit_ratio(rs, "p_hit_tokens"),
        "md_hit_ratio": _hit_ratio(rs, "md_hit_tokens"),
        "pipelines": dict(Counter(r.pipeline or "refused" for r in rs)),
        "handoffs": dict(Counter(r.handoff for r in relayed)),
        "handoff_gap_p99": percentile([r.handoff_gap_s for r in relayed], 99),
        "relay_overload_share": _overload_share(run),
        "relay_fallbacks": int(run.extras.get("relay_fallbacks", 0)),
        "instances": run.extras,
    }


def _wan_utilization(run: SystemRun) -> float:
    """Bytes sent over what the line could carry from the first to the last arrival."""
    if run.wan_gbps is None:
        return 0.0
    span = max(1e-9, run.last_arrival_s)
    return run.wan_bytes * 8 / (run.wan_gbps * 1e9 * span)


def _hit_ratio(rs: Sequence[RequestRecord], field: str) -> float:
    total = sum(r.input_tokens for r in rs)
    return sum(getattr(r, field) for r in rs) / total if total else 0.0


def _overload_share(run: SystemRun) -> float:
    """Share of samples, after the warm-up, where every relay was at capacity."""
    samples = [s for s in run.samples if run.warmup_s <= s.t <= run.score_until_s]
    if not samples:
        return 0.0
    return sum(s.relays_saturated for s in samples) / len(samples)
