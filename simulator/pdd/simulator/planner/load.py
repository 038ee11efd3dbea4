"""What the planner reads each interval: the observed load and the latency it got.

The fields are the router's and workers' metrics over the last interval (docs/metrics.md):
request rate, mean input/output lengths, the hit ratio at P and at MD, the share of
requests relayed, queue time per pool, client-side TTFT and ITL P90 (queue time
included), and the WAN line's estimated rate. Lengths and hits drive the capacity
model; the measured latencies let the planner correct it (:mod:`pdd.simulator.planner.planner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class LoadError(ValueError):
    """An observation the planner cannot use; the message names the field."""


@dataclass(frozen=True)
class Slo:
    """``spec.slo``: client-side TTFT and inter-token latency at the 90th percentile."""

    ttft_p90_s: float
    itl_p90_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_p90_s > 0 and self.itl_p90_s > 0):
            raise LoadError(f"SLO targets must be positive seconds, got {self}")


@dataclass(frozen=True)
class ObservedLoad:
    """One interval's load and what clients saw (NaN: not measured this interval)."""

    rate_rps: float
    input_tokens_mean: float
    output_tokens_mean: float
    p_hit: float  # share of input tokens P found in its prefix cache
    md_hit: float  # share of input tokens MD found in its decode-side cache
    relay_share: float = 0.0  # share of requests the router relayed (P-RLD-MD, P-RLD)
    miss_scv: float = 1.0  # squared coefficient of variation of P's miss per request
    #: P90 of the seconds each request waited in the pool's queue before it was first
    #: scheduled, over the waits that ended this interval (NaN: none ended). A worker's
    #: ``pdd_worker_request_queue_time_seconds`` (scraped) or the simulated instances' own
    #: queues set it alike: the planner blames a pool for a TTFT miss only by it.
    prefill_queue_p90_s: float = math.nan
    main_queue_p90_s: float = math.nan  # MD: waits for a batch slot
    ttft_p90_s: float = math.nan  # client side, queue time included
    itl_p90_s: float = math.nan
    wan_gbps: float = math.nan  # the router's link estimator: what the line carries

    def __post_init__(self) -> None:
        for name in ("rate_rps", "input_tokens_mean", "output_tokens_mean"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise LoadError(f"{name} must be a finite number >= 0, got {value}")
        if not (math.isfinite(self.miss_scv) and self.miss_scv >= 0):
            raise LoadError(f"miss_scv must be a finite number >= 0, got {self.miss_scv}")
        for name in ("prefill_queue_p90_s", "main_queue_p90_s"):
            value = getattr(self, name)
            if not (math.isnan(value) or 0 <= value < math.inf):
                raise LoadError(f"{name} must be seconds >= 0 or NaN (none measured), got {value}")
        for name in ("p_hit", "md_hit", "relay_share"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise LoadError(f"{name} is a share in [0, 1], got {value}")

    @property
    def p_miss_tokens(self) -> float:
        """Tokens P computes per request, on average."""
        return self.input_tokens_mean * (1 - self.p_hit)

    @property
    def md_miss_tokens(self) -> float:
        """Tokens of KV that cross the line per request, on average."""
        return self.input_tokens_mean * (1 - self.md_hit)
