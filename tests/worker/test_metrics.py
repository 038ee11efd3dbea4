"""The per-link WAN series: read off the link meters at scrape time, gone with the link."""

from __future__ import annotations

import pytest

from pdd.local.probes import flatten
from pdd.worker.metrics import WorkerMetrics, loop_time
from pdd.worker.transport.link_meter import LinkKey

pytestmark = pytest.mark.unit

GONE = LinkKey("p-0", "md-old", "prefill", "main")
LIVE = LinkKey("p-0", "md-new", "prefill", "main")


def links_in(metrics: WorkerMetrics) -> set[str]:
    return {
        key.split('dst="')[1].split('"')[0]
        for key in flatten(metrics.render().decode())
        if key.startswith("pdd_worker_wan_rtt_seconds{")
    }


def test_a_peer_gone_longer_than_the_expiry_leaves_the_next_scrape() -> None:
    metrics = WorkerMetrics("prefill")
    expiry = metrics.links.expire_after_s
    now = loop_time()
    metrics.links.meter(GONE, now - expiry - 1).record_rtt(0.05, now - expiry - 1)
    metrics.links.meter(LIVE, now).record_rtt(0.05, now)
    assert links_in(metrics) == {"md-new"}


def test_failures_are_exported_per_reason_and_only_for_reasons_seen() -> None:
    metrics = WorkerMetrics("prefill")
    now = loop_time()
    meter = metrics.links.meter(LIVE, now)
    meter.record_failure("link_down", now)
    meter.record_failure("link_down", now)
    meter.record_failure("peer_error", now)
    samples = flatten(metrics.render().decode())
    failures = {
        k: v for k, v in samples.items() if k.startswith("pdd_worker_wan_transfer_failures")
    }
    assert sorted(failures.values()) == [1.0, 2.0]
    assert any('reason="link_down"' in k and v == 2.0 for k, v in failures.items())
