"""The autoscalers: without the planner, RLD replicas follow the load each relay pod
reports; with it (``spec.planner.enabled``), one HPA per worker role follows the replicas
the planner publishes for that role (docs/planner.md)."""

from __future__ import annotations

from typing import Any

from pdd.operator.builders.meta import Site, metadata
from pdd.operator.naming import RELAY_LOAD_METRIC, Component, Owner
from pdd.operator.spec import PDDSpec, PlannerPool

#: The planner's output, one series per PDDDeployment and role (an External metric).
PLANNER_METRIC = "pdd_planner_desired_replicas"

#: Relay load rises in bursts (a wave of low-hit requests); scale up at once, scale
#: down only after five quiet minutes so a relay is not removed mid-handoff.
SCALE_DOWN_STABILIZATION_SECONDS = 300


def target_quantity(load: float) -> str:
    """A Kubernetes quantity for a fractional load: 0.7 -> "700m"."""
    return f"{round(load * 1000)}m"


def build_relay_hpa(spec: PDDSpec, owner: Owner) -> dict[str, Any]:
    """An autoscaling/v2 HPA on the relay Deployment, driven by the Pods metric
    ``pdd_relay_load`` (served by a custom-metrics adapter from the pods' /metrics)."""
    relay = spec.relay
    metric = {
        "type": "Pods",
        "pods": {
            "metric": {"name": RELAY_LOAD_METRIC},
            "target": {"type": "AverageValue", "averageValue": target_quantity(relay.target_load)},
        },
    }
    site = Site(owner.namespace)
    return _hpa(owner, Component.RELAY, site, relay.min_replicas, relay.max_replicas, metric)


def planner_pool(spec: PDDSpec, role: Component) -> PlannerPool:
    planner = spec.planner
    return {Component.PREFILL: planner.prefill, Component.RELAY: planner.relay}.get(
        role, planner.main_decode
    )


def build_planner_hpa(spec: PDDSpec, owner: Owner, role: Component, site: Site) -> dict[str, Any]:
    """An autoscaling/v2 HPA on ``role``'s Deployment whose External metric is the
    planner's desired replicas for it: at an AverageValue target of 1, HPA's desired count
    is the metric itself, and its own stabilization and ``behavior`` still apply."""
    pool = planner_pool(spec, role)
    selector = {"matchLabels": {"pdddeployment": owner.name, "role": role.value}}
    metric = {
        "type": "External",
        "external": {
            "metric": {"name": PLANNER_METRIC, "selector": selector},
            "target": {"type": "AverageValue", "averageValue": "1"},
        },
    }
    return _hpa(owner, role, site, pool.min_replicas, pool.max_replicas, metric)


def _hpa(
    owner: Owner, role: Component, site: Site, low: int, high: int, metric: dict[str, Any]
) -> dict[str, Any]:
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.child(role)}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(owner, role, owner.child(role), site),
        "spec": {
            "scaleTargetRef": target,
            "minReplicas": low,
            "maxReplicas": high,
            "metrics": [metric],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0},
                "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_STABILIZATION_SECONDS},
            },
        },
    }
