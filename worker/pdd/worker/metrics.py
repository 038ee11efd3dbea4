"""The worker's Prometheus metrics: one registry per process, rendered on ``GET /metrics``.

Counters are bumped where the event happens (a KV chunk leaves on the WAN, a
handoff completes); gauges that mirror engine state are refreshed from the
engine runner's latest stats snapshot right before each scrape, so a scrape
never has to wait for the engine thread.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdd.common.wire import EngineInfo

__all__ = ["CONTENT_TYPE_LATEST", "WorkerMetrics"]


class WorkerMetrics:
    """Every metric a worker exports, labelled with its role where the issue asks for it."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.wan_bytes = Counter(
            "pdd_wan_bytes",
            "KV bytes sent over the WAN path (tensor bytes, no framing)",
            registry=r,
        )
        self.wan_kv_wire_bytes = Counter(
            "pdd_wan_kv_wire_bytes",
            "KV chunk bytes sent over the WAN path as coded (spec.wan.kvCodec; header included)",
            registry=r,
        )
        self.fastpath_bytes = Counter(
            "pdd_fastpath_bytes", "KV bytes sent over the in-datacenter path", registry=r
        )
        self.handoffs = Counter(
            "pdd_handoff", "Completed relay->main handoffs", ["mode"], registry=r
        )
        self.handoff_tokens = Counter(
            "pdd_handoff_tokens", "Token IDs handed from relay to main decode", registry=r
        )
        self.handoff_bytes = Counter(
            "pdd_handoff_bytes", "Payload bytes of token-ID handoff frames", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "pdd_prefix_hit_tokens",
            "Prompt tokens found in this instance's prefix cache",
            ["role"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdd_prompt_tokens",
            "Prompt tokens of requests taken by this instance",
            ["role"],
            registry=r,
        )
        self.transfer_failures = Counter(
            "pdd_transfer_failures",
            "KV transfers or handoffs that ended in an error",
            ["path"],
            registry=r,
        )
        self.wan_wire_bytes = Gauge(
            "pdd_wan_wire_bytes",
            "All bytes this instance sent on WAN channels (framing too)",
            registry=r,
        )
        self.fast_wire_bytes = Gauge(
            "pdd_fastpath_wire_bytes",
            "All bytes this instance sent on in-datacenter channels",
            registry=r,
        )
        self.relay_load = Gauge(
            "pdd_relay_load", "Relay load in [0, 1] (scaling signal)", registry=r
        )
        self.kv_blocks_free = Gauge("pdd_kv_blocks_free", "Free KV blocks", registry=r)
        self.kv_blocks_total = Gauge("pdd_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.running = Gauge("pdd_running_requests", "Requests in the decode batch", registry=r)
        self.engine = Gauge(
            "pdd_worker_engine_info",
            "Always 1; the labels say what the engine runs on",
            ["role", "device", "dtype"],
            registry=r,
        )
        self.kv_capacity_tokens = Gauge(
            "pdd_worker_kv_capacity_tokens", "KV cache capacity in tokens", registry=r
        )
        self.max_running = Gauge(
            "pdd_worker_max_running", "Requests this instance decodes at once", registry=r
        )

    def report_engine(self, info: EngineInfo) -> None:
        """What the engine got, exported once at start (it never changes afterwards)."""
        self.engine.labels(self.role, info.device, info.dtype).set(1)
        self.kv_capacity_tokens.set(info.kv_tokens)
        self.max_running.set(info.max_running)

    def count_prompt(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.prompt_tokens.labels(self.role).inc(prompt_tokens)
        self.prefix_hit_tokens.labels(self.role).inc(hit_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
