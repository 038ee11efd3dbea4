"""What the planner publishes: ``pdd_planner_desired_replicas{pdddeployment_namespace,
pdddeployment, role}`` (each role's HPA targets it as an External metric, through a
metrics adapter: charts/pdd/templates/metrics-adapter-rules.yaml) and the line's verdict,
in a registry of their own that the operator's planner metrics endpoint serves.
"""

from __future__ import annotations

import contextlib
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from pdd.operator.builders.hpa import PLANNER_METRIC
from pdd.operator.naming import WORKER_ROLES, Owner
from pdd.simulator.planner.planner import Decision

#: The PDDDeployment's namespace. Not ``namespace``: Prometheus' scrape sets that to the
#: operator pod's own (and renames ours); the adapter rule maps this one to the HPA's.
NAMESPACE_LABEL = "pdddeployment_namespace"


class PlannerMetrics:
    """The planner's published series, in a registry of their own (the operator's
    planner metrics endpoint serves exactly these)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        labels = [NAMESPACE_LABEL, "pdddeployment"]
        self.desired = Gauge(
            PLANNER_METRIC,
            "Replicas the SLO planner wants for a worker role (each role's HPA targets it)",
            [*labels, "role"],
            registry=r,
        )
        self.line_bound = Gauge(
            "pdd_planner_line_bound",
            "1 when the WAN line, not a replica count, limits the SLO",
            labels,
            registry=r,
        )
        self.line_needed = Gauge(
            "pdd_planner_line_needed_bytes_per_second",
            "The WAN line rate MD's predicted prefix misses need (at the sizing utilization)",
            labels,
            registry=r,
        )

    def publish(self, owner: Owner, decision: Decision) -> None:
        for role, replicas in decision.replicas.items():
            self.desired.labels(owner.namespace, owner.name, role).set(replicas)
        self.line_bound.labels(owner.namespace, owner.name).set(int(decision.line_bound))
        needed = decision.line_gbps_needed * 1e9 / 8
        self.line_needed.labels(owner.namespace, owner.name).set(needed)

    def forget(self, owner: Owner) -> None:
        """Withdraw a deployment's series (its planner stopped: HPAs hold their count)."""
        for role in WORKER_ROLES:
            _remove(self.desired, owner.namespace, owner.name, str(role))
        _remove(self.line_bound, owner.namespace, owner.name)
        _remove(self.line_needed, owner.namespace, owner.name)


def _remove(gauge: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never published
        gauge.remove(*labels)


def serve(metrics: PlannerMetrics, host: str, port: int) -> WSGIServer:
    """Serve ``metrics`` on ``http://host:port/metrics`` (a thread; ``shutdown()`` stops it)."""
    server, _thread = start_http_server(port, host, metrics.registry)
    return server
