"""The router's Prometheus metrics, one registry per router (tests run several in a process).

Latency is measured where the client sees it: TTFT from the request's arrival to the
first released token, ITL between released tokens (a handoff pause shows up here).
Prefix hit ratios are the index's estimate at decision time, per role, so a drifting
MD hit rate (the sign that P's and MD's caches fell out of step) is visible.

Names follow Prometheus' conventions: one prefix (``pdd_router_``), base units (bytes,
seconds), counters end in ``_total`` (prometheus_client appends it to a ``Counter``'s
name), no label named ``instance`` or ``job`` (Prometheus' own target labels).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import choose_encoder

from pdd.common import tracing

__all__ = ["RouterMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
#: ``pdd_router_kv_codec_choices``' label where MD computed its miss (no KV crossed).
COMPUTED_AT_MD = "computed_at_md"


class RouterMetrics:
    """``redis``: a shared Redis store is configured; only then is ``redis_up`` exported
    (a router on local state has no Redis to be down)."""

    def __init__(self, redis: bool = False) -> None:
        self.registry = r = CollectorRegistry()
        tracing.register_metrics(r, "pdd_router")
        self.requests = Counter(
            "pdd_router_requests", "Routed requests", ["pipeline", "reason"], registry=r
        )
        self.kv_codec_choices = Counter(
            "pdd_router_kv_codec_choices",
            "Requests whose KV crosses the WAN, by the codec the router chose for it "
            "(spec.wan.kvCodec: adaptive; computed_at_md, under any codec: none crossed, MD "
            "computed it)",
            ["codec"],
            registry=r,
        )
        self.rejected = Counter(
            "pdd_router_rejected_requests", "Requests refused, by cause", ["cause"], registry=r
        )
        self.ttft = Histogram(
            "pdd_router_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pdd_router_itl_seconds",
            "Time between consecutive tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefix_hit_ratio = Histogram(
            "pdd_router_prefix_hit_ratio",
            "Share of the prompt the chosen instance holds (index estimate)",
            ["role"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "pdd_router_output_tokens", "Tokens relayed to clients", ["source_role"], registry=r
        )
        #: ``tokens`` by source role, looked up once: ``labels()`` costs three times the
        #: ``inc()`` it precedes, once per relayed token.
        self.tokens_from = {role: self.tokens.labels(role) for role in ("relay", "main")}
        self.relayed_share = Histogram(
            "pdd_router_relayed_token_ratio",
            "Per request: share of output tokens that came from a relay (RLD)",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.recoveries = Counter(
            "pdd_router_recoveries",
            "Requests the router carried on after a worker failed, by kind",
            ["kind"],
            registry=r,
        )
        self.admitted = Gauge(
            "pdd_router_admitted_requests",
            "Requests holding a slot of the router's capacity (--max-inflight-requests)",
            registry=r,
        )
        self.queued = Gauge(
            "pdd_router_queued_requests",
            "Requests waiting for a slot of the router's capacity",
            registry=r,
        )
        self.admitting_keys = Gauge(
            "pdd_router_admitted_api_keys",
            "API keys holding at least one slot of the router's capacity",
            registry=r,
        )
        self.stream_buffer = Gauge(
            "pdd_router_stream_buffered_events",
            "Token events the fullest request's stream holds ahead of its client (a slow "
            "reader's; bounded by the router's per-request buffer)",
            registry=r,
        )
        self.asyncio_tasks = Gauge(
            "pdd_router_asyncio_tasks", "The router's asyncio tasks now", registry=r
        )
        self.redis_up = Gauge(
            "pdd_router_redis_up",
            "1 when the shared Redis store is reachable (only where one is configured)",
            registry=r if redis else None,
        )
        self.redis_reads_waiting = Gauge(
            "pdd_router_redis_reads_waiting",
            "Requests waiting now for a Redis read (each at most the Redis deadline)",
            registry=r,
        )
        self.link_state = Gauge(
            "pdd_router_link_state",
            "1 for the WAN line's current condition (healthy, suspected_cut, degraded), else 0",
            ["link", "state"],
            registry=r,
        )
        self.link_transitions = Counter(
            "pdd_router_link_transitions",
            "Changes of the WAN line's condition, by the condition entered",
            ["link", "to"],
            registry=r,
        )
        self.link_goodput = Gauge(
            "pdd_router_link_goodput_bytes_per_second",
            "The WAN line's goodput the router decides on (measured, or the declared prior)",
            ["link"],
            registry=r,
        )
        self.link_backlog = Gauge(
            "pdd_router_link_backlog_bytes",
            "KV this replica dispatched onto the WAN line and has not seen land",
            ["link"],
            registry=r,
        )
        self.relay_slot = Gauge(
            "pdd_router_relay_slot_seconds",
            "What each request already on a relay adds to a relayed first token (measured)",
            registry=r,
        )
        self.prefill_rate = Gauge(
            "pdd_router_prefill_tokens_per_second",
            "P's prefill throughput the router decides on (measured, or the configured prior)",
            ["worker"],
            registry=r,
        )
        self.instances_ready = Gauge(
            "pdd_router_instances_ready", "Workers answering their polls", ["role"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The page in the format the scraper's ``Accept`` asks for, and its content type:
        OpenMetrics (which carries the TTFT and ITL histograms' trace-id exemplars) where
        asked for, else the classic text format."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type
