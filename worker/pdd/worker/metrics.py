"""The worker's Prometheus metrics: one registry per process, rendered on ``GET /metrics``.

Counters are bumped where the event happens (a KV chunk leaves on the WAN, a
handoff completes); gauges that mirror engine state are refreshed from the
engine runner's latest stats snapshot right before each scrape, so a scrape
never has to wait for the engine thread. The per-link WAN series (``pdd_worker_wan_*`` with
``src``/``dst``) are read off the link meters at scrape time, so a link the meters
forgot is gone from the next scrape with no bookkeeping here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from pdd.common.metrics import ComponentMetrics
from pdd.common.vocabulary import RELAY_LOAD_METRIC
from pdd.common.wire import EngineInfo
from pdd.worker.transport.link_meter import LinkMeters

if TYPE_CHECKING:  # the engine's package imports torch; a scrape's reader need not
    from pdd.worker.engine.request import RequestOutput

__all__ = ["CONTENT_TYPE_LATEST", "WorkerMetrics"]

#: Prefill time buckets, seconds: from a few-token miss of a small model on a CPU (ms)
#: to a long prompt of a large one (tens of seconds).
PREFILL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


#: Queue time buckets, seconds: fine at the low end, so an idle queue's P90 (the planner's
#: signal, interpolated inside a bucket as ``histogram_quantile`` does) reads as milliseconds
#: rather than a first bucket's width; up to the minutes a collapsed queue holds requests.
QUEUE_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip


class WorkerMetrics(ComponentMetrics):
    """Every metric a worker exports, labelled with its role where the issue asks for it.

    Names follow Prometheus' conventions (``pdd.common.metrics``, the router's too): base
    units (bytes, seconds), counters end in ``_total`` (appended on exposition), one prefix.
    """

    def __init__(self, role: str) -> None:
        super().__init__("pdd_worker")
        self.role = role
        #: Every WAN link this instance is an end of (see ``pdd.worker.transport.link_meter``).
        self.links = LinkMeters()
        self.registry.register(WanLinkCollector(self.links))
        #: All bytes sent on WAN / in-datacenter channels (framing too), as the transport
        #: counts them; exported as counters at scrape time (``refresh_gauges`` updates them).
        self.wire_sent = {"wan": 0, "fastpath": 0}
        self.registry.register(WireBytesCollector(self.wire_sent))
        self.wan_bytes = self.counter(
            "pdd_worker_wan_kv_bytes",
            "KV bytes sent over the WAN path (tensor bytes, no framing)",
        )
        self.wan_kv_wire_bytes = self.counter(
            "pdd_worker_wan_kv_coded_bytes",
            "KV chunk bytes sent over the WAN path as coded (spec.wan.kvCodec; header included)",
        )
        self.fastpath_bytes = self.counter(
            "pdd_worker_fastpath_kv_bytes",
            "KV bytes sent over the in-datacenter path",
        )
        self.handoffs = self.counter(
            "pdd_worker_handoffs", "Completed relay->main handoffs", ["mode"]
        )
        self.handoff_tokens = self.counter(
            "pdd_worker_handoff_tokens", "Token IDs handed from relay to main decode"
        )
        self.handoff_bytes = self.counter(
            "pdd_worker_handoff_bytes", "Payload bytes of token-ID handoff frames"
        )
        self.prefix_hit_tokens = self.counter(
            "pdd_worker_prefix_hit_tokens",
            "Prompt tokens found in this instance's prefix cache",
            ["role"],
        )
        self.prompt_tokens = self.counter(
            "pdd_worker_prompt_tokens",
            "Prompt tokens of requests taken by this instance",
            ["role"],
        )
        self.prefill_time = self.histogram(
            "pdd_worker_request_prefill_time_seconds",
            "Seconds from the step that began computing a request's prompt here to its first "
            "token (queueing before it excluded; requests whose KV came from elsewhere are "
            "not counted)",
            PREFILL_BUCKETS_S,
            ["role"],
        )
        self.queue_time = self.histogram(
            "pdd_worker_request_queue_time_seconds",
            "Seconds a request waited in this instance's queue until the engine first "
            "scheduled it (requests whose KV came from elsewhere never queue here and are "
            "not counted); the planner's queue signal",
            QUEUE_BUCKETS_S,
            ["role"],
        )
        self.transfer_failures = self.counter(
            "pdd_worker_transfer_failures",
            "KV transfers or handoffs that ended in an error",
            ["path"],
        )
        self.kv_waits = self.counter(
            "pdd_worker_kv_block_waits",
            "Requests whose KV attach waited for blocks to free (none were free, even after "
            "eviction and preemption) instead of being refused",
        )
        self.relay_load = self.gauge(
            RELAY_LOAD_METRIC, "Relay load in [0, 1] (the relay HPA's signal)"
        )
        self.kv_blocks_free = self.gauge("pdd_worker_kv_blocks_free", "Free KV blocks")
        self.kv_blocks_total = self.gauge("pdd_worker_kv_blocks", "KV blocks in the pool")
        self.kv_usage = self.gauge(
            "pdd_worker_kv_usage_ratio",
            "Share of the KV blocks requests hold (0..1; blocks the prefix cache keeps count "
            "as free: they are evicted on demand)",
        )
        self.running = self.gauge("pdd_worker_running_requests", "Requests in the decode batch")
        self.waiting = self.gauge(
            "pdd_worker_waiting_requests",
            "Requests queued for the engine (not yet running): the queue depth",
        )
        self.engine = self.gauge(
            "pdd_worker_engine_info",
            "Always 1; the labels say what the engine runs on",
            ["role", "device", "dtype"],
        )
        self.kv_capacity_tokens = self.gauge(
            "pdd_worker_kv_capacity_tokens", "KV cache capacity in tokens"
        )
        self.max_running_requests = self.gauge(
            "pdd_worker_max_running_requests",
            "Requests this instance decodes at once",
        )

    def report_engine(self, info: EngineInfo) -> None:
        """What the engine got, exported once at start (it never changes afterwards)."""
        self.engine.labels(self.role, info.device, info.dtype).set(1)
        self.kv_capacity_tokens.set(info.kv_tokens)
        self.max_running_requests.set(info.max_running_requests)

    def count_prompt(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.prompt_tokens.labels(self.role).inc(prompt_tokens)
        self.prefix_hit_tokens.labels(self.role).inc(hit_tokens)

    def observe_first_token(self, out: RequestOutput) -> None:
        """The prefill and queue times an engine output carries (only the output with a
        request's first token here has them: each is observed once per request)."""
        if out.prefill_time_s is not None:
            self.prefill_time.labels(self.role).observe(out.prefill_time_s)
        if out.queue_time_s is not None:
            self.queue_time.labels(self.role).observe(out.queue_time_s)


class WireBytesCollector(Collector):
    """``pdd_worker_{wan,fastpath}_wire_bytes_total``: the transport's own running totals
    of bytes sent (they only grow), read when scraped."""

    def __init__(self, sent: dict[str, int]) -> None:
        self.sent = sent

    def collect(self) -> Iterator[Metric]:
        for path, doc in (
            ("wan", "All bytes this instance sent on WAN channels (framing too)"),
            ("fastpath", "All bytes this instance sent on in-datacenter channels"),
        ):
            family = CounterMetricFamily(f"pdd_worker_{path}_wire_bytes", doc)
            family.add_metric([], self.sent[path])
            yield family


LINK_LABELS = ("src", "dst", "src_pool", "dst_pool")


def loop_time() -> float:
    """The clock the channels stamp events with: the running event loop's (virtual in
    the virtual-clock tests); ``time.monotonic`` (the same clock in production) outside."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class WanLinkCollector(Collector):
    """``pdd_worker_wan_*`` per directed link, from the link meters' snapshots at scrape time.

    Both ends of a link export their own view with the same ``src``/``dst``; the scrape
    target's labels (pod, instance) tell them apart. Queued and in-flight bytes are the
    sender's (0 at the receiving end).
    """

    def __init__(self, links: LinkMeters) -> None:
        self.links = links

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=LINK_LABELS)

        goodput = gauge(
            "pdd_worker_wan_goodput_bytes_per_second",
            "Bytes the link delivered per second over the sliding window (frames as sent)",
        )
        rtt = gauge("pdd_worker_wan_rtt_seconds", "Smoothed round-trip time (RFC 6298)")
        rtt_min = gauge(
            "pdd_worker_wan_rtt_min_seconds",
            "Least round-trip time of the last minute (propagation)",
        )
        queued = gauge("pdd_worker_wan_queued_bytes", "Bytes committed to the link, not yet sent")
        in_flight = gauge(
            "pdd_worker_wan_in_flight_bytes", "Bytes sent, not yet confirmed by the peer"
        )
        failures = CounterMetricFamily(
            "pdd_worker_wan_transfer_failures",
            "Transfers on the link that failed, by reason",
            labels=(*LINK_LABELS, "reason"),
        )
        timeouts = CounterMetricFamily(
            "pdd_worker_wan_transfer_timeouts",
            "Waits for the peer on the link that ran out (connect, credit, read)",
            labels=LINK_LABELS,
        )
        for key, snap in self.links.snapshots(loop_time()):
            labels = [key.src, key.dst, key.src_pool, key.dst_pool]
            goodput.add_metric(labels, snap.goodput_bps)
            if snap.rtt_s is not None and snap.rtt_min_s is not None:
                rtt.add_metric(labels, snap.rtt_s)
                rtt_min.add_metric(labels, snap.rtt_min_s)
            queued.add_metric(labels, snap.queued_bytes)
            in_flight.add_metric(labels, snap.in_flight_bytes)
            for reason, count in sorted(snap.failures.items()):
                failures.add_metric([*labels, reason], count)
            timeouts.add_metric(labels, snap.timeouts)
        yield from (goodput, rtt, rtt_min, queued, in_flight, failures, timeouts)
