"""The Grafana dashboard and the prometheus-adapter rule speak the metric names PDD exports."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from pdd.operator.naming import RELAY_LOAD_METRIC
from pdd.router.metrics import RouterMetrics
from pdd.worker.metrics import WorkerMetrics, loop_time
from pdd.worker.transport.link_meter import LinkKey

pytestmark = pytest.mark.unit


#: Every metric the router and workers can export, as exposed (a counter with its
#: ``_total``): from the code's own registries, so a renamed metric fails here.
def exported_metrics() -> set[str]:
    names = set()
    for registry in (RouterMetrics(redis=True).registry, WorkerMetrics("prefill").registry):
        for family in registry.collect():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


#: What a worker exports per WAN link (``pdd.worker.metrics.WanLinkCollector``).
WAN_LINK_METRICS = {
    "pdd_worker_wan_goodput_bytes_per_second",
    "pdd_worker_wan_rtt_seconds",
    "pdd_worker_wan_rtt_min_seconds",
    "pdd_worker_wan_queued_bytes",
    "pdd_worker_wan_in_flight_bytes",
    "pdd_worker_wan_transfer_failures_total",
    "pdd_worker_wan_transfer_timeouts_total",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_NAME = re.compile(r"\bpdd_[a-z_]+\b")


def _base_name(name: str, known: set[str]) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in known:
            return name.removesuffix(suffix)
    return name


def test_dashboard_reads_only_metrics_the_code_exports(chart, find_object) -> None:
    objects = chart.objects({"grafana": {"dashboard": {"enabled": True}}})
    config_map = find_object(objects, "ConfigMap", "pdd-dashboard")
    dashboard = json.loads(config_map["data"]["pdd-overview.json"])
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    known = exported_metrics()
    used = {_base_name(name, known) for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert used <= known, used - known
    assert used >= WAN_LINK_METRICS
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Time to first token", "Pipeline mix", "WAN throughput", "Relay load"} <= titles
    assert {"WAN link goodput", "WAN link RTT", "WAN link backlog"} <= titles
    # What an on-call engineer opens the dashboard for first.
    assert {"Errors", "Error ratio", "Inter-token latency", "KV cache usage", "Queue depth",
            "WAN line condition"} <= titles  # fmt: skip


def test_dashboard_panels_read_errors_itl_kv_usage_and_queue_depth(chart) -> None:
    dashboard = json.loads((chart.path / "dashboards" / "pdd-overview.json").read_text())
    exprs = {panel["title"]: " ".join(t["expr"] for t in panel["targets"])
             for panel in dashboard["panels"]}  # fmt: skip
    assert "pdd_router_rejected_requests_total" in exprs["Errors"]
    assert "pdd_router_itl_seconds_bucket" in exprs["Inter-token latency"]
    assert "pdd_worker_kv_usage_ratio" in exprs["KV cache usage"]
    assert "pdd_worker_waiting_requests" in exprs["Queue depth"]
    assert "by (link, state)" in exprs["WAN line condition"]


def test_worker_exports_every_wan_link_metric_the_dashboard_reads() -> None:
    """A link with every event behind it: each per-link series exists, labelled by link."""
    metrics = WorkerMetrics("prefill")
    now = loop_time()  # the clock the scrape reads the meters with
    meter = metrics.links.meter(LinkKey("p-0", "md-0", "prefill", "main"), now)
    meter.record_rtt(0.05, now)
    meter.record_failure("link_down", now)
    exported = {
        family.name + ("_total" if family.type == "counter" else ""): family
        for family in metrics.registry.collect()
        if family.name.startswith("pdd_worker_wan_") and family.samples
    }
    assert set(exported) >= WAN_LINK_METRICS
    for name in WAN_LINK_METRICS:
        [sample] = exported[name].samples
        assert {k: sample.labels[k] for k in ("src", "dst", "src_pool", "dst_pool")} == {
            "src": "p-0",
            "dst": "md-0",
            "src_pool": "prefill",
            "dst_pool": "main",
        }


def test_wan_link_panels_show_one_line_per_link(chart) -> None:
    dashboard = json.loads((chart.path / "dashboards" / "pdd-overview.json").read_text())
    for panel in dashboard["panels"]:
        if panel["title"].startswith("WAN link"):
            for target in panel["targets"]:
                assert "by (src, dst" in target["expr"] and "{{src}}" in target["legendFormat"]


def test_dashboard_reads_ttft_as_a_histogram_and_mix_by_pipeline(chart) -> None:
    dashboard = json.loads((chart.path / "dashboards" / "pdd-overview.json").read_text())
    exprs = {panel["title"]: [t["expr"] for t in panel["targets"]] for panel in dashboard["panels"]}
    assert all(
        "histogram_quantile" in e and "pdd_router_ttft_seconds_bucket" in e
        for e in exprs["Time to first token"]
    )
    assert any("by (pipeline)" in e for e in exprs["Pipeline mix"])
    assert any("reason" in e for e in exprs["Pipeline choice reasons"])


def test_dashboard_configmap_is_found_by_the_grafana_sidecar_label(chart, find_object) -> None:
    objects = chart.objects({"grafana": {"dashboard": {"enabled": True, "namespace": "grafana"}}})
    config_map = find_object(objects, "ConfigMap", "pdd-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "grafana"


def test_dashboard_is_off_by_default(chart) -> None:
    assert [o for o in chart.objects() if o["metadata"]["name"] == "pdd-dashboard"] == []


def test_adapter_rule_exposes_relay_load_per_pod_under_the_hpa_metric_name(
    chart, find_object
) -> None:
    objects = chart.objects({"metricsAdapter": {"namespace": "monitoring"}})
    config_map = find_object(objects, "ConfigMap", "pdd-adapter-rules")
    assert config_map["metadata"]["namespace"] == "monitoring"
    [rule] = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    assert rule["seriesQuery"].startswith("pdd_worker_relay_load{")
    assert rule["name"]["as"] == RELAY_LOAD_METRIC  # what the operator's relay HPA asks for
    # A Pods metric needs the series tied to pods and namespaces.
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    assert "<<.LabelMatchers>>" in rule["metricsQuery"]
    assert "by (<<.GroupBy>>)" in rule["metricsQuery"]


def test_adapter_rules_can_be_switched_off(chart) -> None:
    objects = chart.objects({"metricsAdapter": {"rules": {"enabled": False, "window": "1m"}}})
    assert [o for o in objects if o["metadata"]["name"] == "pdd-adapter-rules"] == []
