"""The chart wires the SLO planner: the operator serves pdd_planner_desired_replicas where
Prometheus scrapes it, and the adapter serves it, per PDDDeployment namespace, as the
External metric each role's HPA asks for (operator/builders/hpa.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from pdd.operator.builders.hpa import PLANNER_METRIC
from pdd.operator.main import parse_args
from pdd.operator.planner_publish import NAMESPACE_LABEL

pytestmark = pytest.mark.unit


def operator_pod(objects: list[dict[str, Any]], find_object) -> dict[str, Any]:
    return find_object(objects, "Deployment", "pdd-operator")["spec"]["template"]


def test_the_operator_serves_the_planners_metrics_where_prometheus_scrapes(
    chart, find_object
) -> None:
    pod = operator_pod(chart.objects({"operator": {"podAnnotations": {"team": "ml"}}}), find_object)
    [container] = pod["spec"]["containers"]
    args = parse_args(container["args"])  # the flags pdd operator takes
    assert (args.planner_metrics_port, args.planner_scenario) == (9464, "published")
    assert {"name": "planner-metrics", "containerPort": 9464} in container["ports"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9464" and annotations["team"] == "ml"


def test_port_zero_serves_nothing(chart, find_object) -> None:
    values = {"operator": {"planner": {"metricsPort": 0, "scenario": "published"}}}
    pod = operator_pod(chart.objects(values), find_object)
    [container] = pod["spec"]["containers"]
    assert parse_args(container["args"]).planner_metrics_port is None
    assert "annotations" not in pod["metadata"]


def test_the_adapter_serves_desired_replicas_as_an_external_metric_per_namespace(
    chart, find_object
) -> None:
    config_map = find_object(chart.objects(), "ConfigMap", "pdd-adapter-rules")
    [rule] = yaml.safe_load(config_map["data"]["config.yaml"])["externalRules"]
    assert rule["seriesQuery"].startswith(f"{PLANNER_METRIC}{{")
    assert rule["name"]["as"] == PLANNER_METRIC  # what each role's HPA asks for
    assert rule["resources"]["overrides"] == {NAMESPACE_LABEL: {"resource": "namespace"}}
    assert "<<.LabelMatchers>>" in rule["metricsQuery"]
