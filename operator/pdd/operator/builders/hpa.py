"""The relay autoscaler: RLD replicas follow the load each relay pod reports."""

from __future__ import annotations

from typing import Any

from pdd.operator.builders.meta import Site, metadata
from pdd.operator.naming import RELAY_LOAD_METRIC, Component, Owner
from pdd.operator.spec import PDDSpec

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
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(
            owner, Component.RELAY, owner.child(Component.RELAY), Site(owner.namespace)
        ),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": owner.child(Component.RELAY),
            },
            "minReplicas": relay.min_replicas,
            "maxReplicas": relay.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": RELAY_LOAD_METRIC},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": target_quantity(relay.target_load),
                        },
                    },
                }
            ],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0},
                "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_STABILIZATION_SECONDS},
            },
        },
    }
