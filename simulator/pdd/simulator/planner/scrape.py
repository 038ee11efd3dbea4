"""What the planner reads: the router's and workers' Prometheus metrics, scraped twice,
made into one interval's :class:`~pdd.simulator.planner.load.ObservedLoad`, and
:class:`PlannerRound`, which steps the :class:`~pdd.simulator.planner.planner.Planner`
on each interval between two scrapes.

Here, beside the planner, because two products scrape and decide alike: the operator's
planner loop (pods found in the clusters) and ``pdd up --autoscale`` (the local stack's
processes); the operator and pdd.local may not import each other.

Pure functions on exposition text (docs/metrics.md names every metric), so the parsing
and the arithmetic are tested on recorded text without a cluster. Counters and
histograms are cumulative per process: an interval's figure is the difference between
two scrapes of the same pod, and a pod whose counters went down (it restarted) or that
was not there before (a new replica) counts from zero, as Prometheus' ``increase`` does.

* rate: routed requests (``pdd_router_requests_total``) per second;
* lengths: prompt tokens MD took per request that reached MD (P's when none did), output
  tokens relayed to clients per request;
* hits: prefix-hit over prompt tokens at P and at MD (``pdd_worker_prefix_hit_tokens``;
  MD's pods unreachable, as in cluster B: the routers' estimate at decision time);
* relay share: requests routed P-RLD-MD or P-RLD;
* queues: the P90 of each role's ``pdd_worker_request_queue_time_seconds`` increase: the
  time requests scheduled in the interval had waited (a gauge of waiting requests, read at
  the scrape's instant, sees a queue only if one stands then);
* client TTFT and ITL P90: the router's histograms (TTFT from arrival: queue time in);
* the line: the router's link estimate (``pdd_router_link_goodput_bytes_per_second``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pdd.common.vocabulary import Pipeline, Role
from pdd.simulator.planner.load import ObservedLoad
from pdd.simulator.planner.planner import Decision, Planner

#: The role label a router pod's scrape carries (workers carry their worker role).
ROUTER = "router"
#: Each request's wait in a worker's queue until first scheduled (worker/metrics.py).
QUEUE_TIME = "pdd_worker_request_queue_time_seconds"
_CUMULATIVE = ("_total", "_bucket", "_count", "_sum")
_RELAYED = {Pipeline.P_RLD_MD.value, Pipeline.P_RLD.value}
_THROUGH_MD = {Pipeline.P_MD.value, Pipeline.P_RLD_MD.value}

SampleKey = tuple[str, frozenset[tuple[str, str]]]


class MetricsError(ValueError):
    """Exposition text that does not parse; the message says which pod."""


@dataclass(frozen=True)
class PodMetrics:
    """One pod's samples at one scrape: ``(sample name, labels) -> value``."""

    pod: str
    role: str
    samples: Mapping[SampleKey, float]

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.samples)


def parse_exposition(text: str, pod: str, role: str) -> PodMetrics:
    """One scrape's text; MetricsError when it is not Prometheus' text format."""
    samples: dict[SampleKey, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not s.name.endswith("_created"):
                    samples[(s.name, frozenset(s.labels.items()))] = s.value
    except ValueError as exc:
        raise MetricsError(f"pod {pod}: metrics do not parse: {exc}") from None
    return PodMetrics(pod, role, samples)


def _cumulative(name: str) -> bool:
    return name.endswith(_CUMULATIVE)


def increase(before: PodMetrics | None, after: PodMetrics) -> PodMetrics:
    """``after``'s counters and histograms less ``before``'s (gauges as ``after`` has
    them); all of ``after`` when there is no earlier scrape or a counter went down."""
    if before is None:
        return after
    old = before.samples
    reset = any(_cumulative(k[0]) and v < old.get(k, 0.0) for k, v in after.samples.items())
    if reset:
        return after
    return PodMetrics(
        after.pod,
        after.role,
        {k: (v - old.get(k, 0.0)) if _cumulative(k[0]) else v for k, v in after.samples.items()},
    )


def increases(
    before: Mapping[str, PodMetrics], after: Mapping[str, PodMetrics]
) -> list[PodMetrics]:
    """Each pod of ``after`` over the interval since ``before`` (pods keyed by name)."""
    return [increase(before.get(pod), now) for pod, now in after.items()]


def histogram_p90(pods: Iterable[PodMetrics], name: str) -> float:
    """The P90 of a histogram's observations in the interval, interpolated inside its
    bucket as PromQL's ``histogram_quantile`` does; NaN when nothing was observed."""
    buckets: dict[float, float] = {}
    for pod in pods:
        for (n, labels), v in pod.samples.items():
            if n == f"{name}_bucket":
                le = float(dict(labels)["le"])
                buckets[le] = buckets.get(le, 0.0) + v
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank = 0.9 * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if math.isinf(le):  # past the last finite bound: that bound, as PromQL says
                return lower
            inside = buckets[le] - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, buckets[le]
    return lower


def _share(part: float, whole: float) -> float:
    return min(1.0, max(0.0, part / whole)) if whole > 0 else 0.0


def _router_estimate(routers: list[PodMetrics], role: str) -> float:
    """The routers' mean estimate of ``role``'s prefix hit (``pdd_router_prefix_hit_ratio``):
    where that role's pods could not be scraped (MD in cluster B, its Role granting no pods)."""
    name = "pdd_router_prefix_hit_ratio"
    count = sum(p.total(f"{name}_count", role=role) for p in routers)
    return _share(sum(p.total(f"{name}_sum", role=role) for p in routers), count)


def _total(pods: list[PodMetrics], name: str, **labels: str) -> float:
    return sum(p.total(name, **labels) for p in pods)


def _by_pipeline(routers: list[PodMetrics]) -> dict[str, float]:
    """Routed requests per pipeline, over every router."""
    out: dict[str, float] = {}
    for p in routers:
        for (n, labels), v in p.samples.items():
            if n == "pdd_router_requests_total":
                key = dict(labels).get("pipeline", "")
                out[key] = out.get(key, 0.0) + v
    return out


def _link_gbps(routers: list[PodMetrics]) -> float:
    """The routers' mean estimate of the line's rate, Gbit/s (NaN: none reported)."""
    name = "pdd_router_link_goodput_bytes_per_second"
    link = [p.total(name) for p in routers if p.has(name)]
    return sum(link) / len(link) * 8 / 1e9 if link else math.nan


def observed_load(interval: list[PodMetrics], seconds: float) -> ObservedLoad:
    """One interval's load from every pod's increase over it (:func:`increases`)."""
    if seconds <= 0:
        raise MetricsError(f"an interval must last > 0 s, got {seconds}")
    by_role: dict[str, list[PodMetrics]] = {}
    for pod in interval:
        by_role.setdefault(pod.role, []).append(pod)
    routers = by_role.get(ROUTER, [])
    prefill, main = by_role.get(Role.PREFILL.value, []), by_role.get(Role.MAIN.value, [])
    pipelines = _by_pipeline(routers)
    routed, to_md = sum(pipelines.values()), sum(pipelines.get(p, 0.0) for p in _THROUGH_MD)
    p_prompt = _total(prefill, "pdd_worker_prompt_tokens_total")
    md_prompt = _total(main, "pdd_worker_prompt_tokens_total")
    md_seen = md_prompt > 0 and to_md > 0
    per_request = 1 / routed if routed > 0 else 0.0
    return ObservedLoad(
        rate_rps=routed / seconds,
        input_tokens_mean=md_prompt / to_md if md_seen else p_prompt * per_request,
        output_tokens_mean=_total(routers, "pdd_router_output_tokens_total") * per_request,
        p_hit=_share(_total(prefill, "pdd_worker_prefix_hit_tokens_total"), p_prompt),
        md_hit=_share(_total(main, "pdd_worker_prefix_hit_tokens_total"), md_prompt)
        if md_seen
        else _router_estimate(routers, Role.MAIN.value),
        relay_share=_share(sum(pipelines.get(p, 0.0) for p in _RELAYED), routed),
        prefill_queue_p90_s=histogram_p90(prefill, QUEUE_TIME),
        main_queue_p90_s=histogram_p90(main, QUEUE_TIME),
        ttft_p90_s=histogram_p90(routers, "pdd_router_ttft_seconds"),
        itl_p90_s=histogram_p90(routers, "pdd_router_itl_seconds"),
        wan_gbps=_link_gbps(routers),
    )


@dataclass
class PlannerRound:
    """The planner and the last scrape: each ``step`` decides on the interval since."""

    planner: Planner
    last: dict[str, PodMetrics] = field(default_factory=dict)
    last_at: float | None = None

    def step(self, scraped: Mapping[str, PodMetrics], now: float) -> Decision | None:
        """A decision on the interval since the last scrape; None on the first scrape
        or when no router answered (no data is not zero load: nothing is scaled down)."""
        if not any(p.role == ROUTER for p in scraped.values()):
            return None
        before, since = self.last, self.last_at
        self.last, self.last_at = dict(scraped), now
        if since is None or now <= since:
            return None
        load = observed_load(increases(before, scraped), now - since)
        return self.planner.observe(load)
