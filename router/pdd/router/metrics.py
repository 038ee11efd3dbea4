"""The router's Prometheus metrics, one registry per router (tests run several in a process).

Latency is measured where the client sees it: TTFT from the request's arrival to the
first released token, ITL between released tokens (a handoff pause shows up here).
Prefix hit ratios are the index's estimate at decision time, per role, so a drifting
MD hit rate (the sign that P's and MD's caches fell out of step) is visible.

Names follow Prometheus' conventions, which ``pdd.common.metrics`` holds for the router
and the worker alike: one prefix (``pdd_router_``), base units (bytes, seconds), counters
end in ``_total`` (appended on exposition), no label named ``instance`` or ``job``.
"""

from __future__ import annotations

from pdd.common.metrics import ComponentMetrics

__all__ = ["RouterMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
#: ``pdd_router_kv_codec_choices``' label where MD computed its miss (no KV crossed).
COMPUTED_AT_MD = "computed_at_md"


class RouterMetrics(ComponentMetrics):
    """``redis``: a shared Redis store is configured; only then is ``redis_up`` exported
    (a router on local state has no Redis to be down)."""

    def __init__(self, redis: bool = False) -> None:
        super().__init__("pdd_router")
        self.requests = self.counter(
            "pdd_router_requests", "Routed requests", ["pipeline", "reason"]
        )
        self.kv_codec_choices = self.counter(
            "pdd_router_kv_codec_choices",
            "Requests whose KV crosses the WAN, by the codec the router chose for it "
            "(spec.wan.kvCodec: adaptive; computed_at_md, under any codec: none crossed, MD "
            "computed it)",
            ["codec"],
        )
        self.rejected = self.counter(
            "pdd_router_rejected_requests", "Requests refused, by cause", ["cause"]
        )
        self.ttft = self.histogram(
            "pdd_router_ttft_seconds", "Time to first token", _LATENCY_BUCKETS
        )
        self.itl = self.histogram(
            "pdd_router_itl_seconds", "Time between consecutive tokens", _LATENCY_BUCKETS
        )
        self.prefix_hit_ratio = self.histogram(
            "pdd_router_prefix_hit_ratio",
            "Share of the prompt the chosen instance holds (index estimate)",
            _RATIO_BUCKETS,
            ["role"],
        )
        self.tokens = self.counter(
            "pdd_router_output_tokens", "Tokens relayed to clients", ["source_role"]
        )
        #: ``tokens`` by source role, looked up once: ``labels()`` costs three times the
        #: ``inc()`` it precedes, once per relayed token.
        self.tokens_from = {role: self.tokens.labels(role) for role in ("relay", "main")}
        self.relayed_share = self.histogram(
            "pdd_router_relayed_token_ratio",
            "Per request: share of output tokens that came from a relay (RLD)",
            _RATIO_BUCKETS,
        )
        self.recoveries = self.counter(
            "pdd_router_recoveries",
            "Requests the router carried on after a worker failed, by kind",
            ["kind"],
        )
        self.admitted = self.gauge(
            "pdd_router_admitted_requests",
            "Requests holding a slot of the router's capacity (--max-inflight-requests)",
        )
        self.queued = self.gauge(
            "pdd_router_queued_requests", "Requests waiting for a slot of the router's capacity"
        )
        self.admitting_keys = self.gauge(
            "pdd_router_admitted_api_keys",
            "API keys holding at least one slot of the router's capacity",
        )
        self.stream_buffer = self.gauge(
            "pdd_router_stream_buffered_events",
            "Token events the fullest request's stream holds ahead of its client (a slow "
            "reader's; bounded by the router's per-request buffer)",
        )
        self.asyncio_tasks = self.gauge(
            "pdd_router_asyncio_tasks", "The router's asyncio tasks now"
        )
        self.redis_up = self.gauge(
            "pdd_router_redis_up",
            "1 when the shared Redis store is reachable (only where one is configured)",
            exported=redis,
        )
        self.redis_reads_waiting = self.gauge(
            "pdd_router_redis_reads_waiting",
            "Requests waiting now for a Redis read (each at most the Redis deadline)",
        )
        self.link_state = self.gauge(
            "pdd_router_link_state",
            "1 for the WAN line's current condition (healthy, suspected_cut, degraded), else 0",
            ["link", "state"],
        )
        self.link_transitions = self.counter(
            "pdd_router_link_transitions",
            "Changes of the WAN line's condition, by the condition entered",
            ["link", "to"],
        )
        self.link_goodput = self.gauge(
            "pdd_router_link_goodput_bytes_per_second",
            "The WAN line's goodput the router decides on (measured, or the declared prior)",
            ["link"],
        )
        self.link_backlog = self.gauge(
            "pdd_router_link_backlog_bytes",
            "KV this replica dispatched onto the WAN line and has not seen land",
            ["link"],
        )
        self.relay_slot = self.gauge(
            "pdd_router_relay_slot_seconds",
            "What each request already on a relay adds to a relayed first token (measured)",
        )
        self.prefill_rate = self.gauge(
            "pdd_router_prefill_tokens_per_second",
            "P's prefill throughput the router decides on (measured, or the configured prior)",
            ["worker"],
        )
        self.instances_ready = self.gauge(
            "pdd_router_instances_ready", "Workers answering their polls", ["role"]
        )
