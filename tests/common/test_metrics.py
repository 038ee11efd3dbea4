"""A component's metrics are defined the project's one way: its prefix, no ``_total`` in a
name (exposition appends it to counters), no label Prometheus sets on a scrape, and the
process's dropped-spans counter on every registry."""

from __future__ import annotations

import pytest

from pdd.common.metrics import ComponentMetrics

pytestmark = pytest.mark.unit


def names_on_the_page(metrics: ComponentMetrics) -> set[str]:
    return {
        line.split("{")[0].split(" ")[0]
        for line in metrics.render().decode().splitlines()
        if line and not line.startswith("#")
    }


def test_counters_gauges_and_histograms_land_on_the_components_page() -> None:
    metrics = ComponentMetrics("pdd_router")
    metrics.counter("pdd_router_requests", "Routed requests", ["pipeline"]).labels("pdd").inc()
    metrics.gauge("pdd_router_queued_requests", "Requests waiting").set(3)
    metrics.histogram("pdd_router_ttft_seconds", "Time to first token", (0.1, 1.0)).observe(0.5)
    page = names_on_the_page(metrics)
    assert {
        "pdd_router_requests_total",
        "pdd_router_queued_requests",
        "pdd_router_ttft_seconds_bucket",
        "pdd_router_trace_spans_dropped_total",
    } <= page


def test_a_gauge_not_exported_is_left_off_the_page() -> None:
    metrics = ComponentMetrics("pdd_router")
    metrics.gauge("pdd_router_redis_up", "1 when Redis answers", exported=False).set(1)
    assert "pdd_router_redis_up" not in names_on_the_page(metrics)


@pytest.mark.parametrize(
    ("name", "labels", "reason"),
    [
        ("pdd_worker_requests", (), "pdd_router_"),
        ("router_requests", (), "pdd_router_"),
        ("pdd_router_requests_total", (), "_total"),
        ("pdd_router_requests", ("instance",), "instance"),
        ("pdd_router_requests", ("pipeline", "job"), "job"),
    ],
)
def test_a_name_or_label_off_the_convention_is_refused_with_the_rule(
    name: str, labels: tuple[str, ...], reason: str
) -> None:
    metrics = ComponentMetrics("pdd_router")
    with pytest.raises(ValueError, match=reason):
        metrics.gauge(name, "anything", labels)


def test_exposition_speaks_openmetrics_where_asked_and_text_otherwise() -> None:
    metrics = ComponentMetrics("pdd_worker")
    _, openmetrics = metrics.exposition("application/openmetrics-text; version=1.0.0")
    _, text = metrics.exposition("")
    assert openmetrics.startswith("application/openmetrics-text")
    assert text.startswith("text/plain")
