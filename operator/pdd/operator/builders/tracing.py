"""Tracing in every pod: the standard ``OTEL_*`` variables from spec.observability.tracing.

The router and the workers read these themselves (``pdd.common.tracing``), so one trace
per request crosses every pod of both datacenters. Each pod names its role
(``service.name``), and its resource attributes say where it runs: the datacenter (A, B),
the pool, and the Kubernetes names a trace backend groups by.
"""

from __future__ import annotations

from typing import Any

from pdd.common.vocabulary import datacenter
from pdd.operator.builders.meta import Site
from pdd.operator.naming import Component, Owner
from pdd.operator.spec import PDDSpec

#: A ratio of requests, honouring a client's sampled ``traceparent`` (vLLM's and the
#: SDK's name for it).
SAMPLER = "parentbased_traceidratio"
#: The variable ``_common_env`` sets to the pod's name, expanded by kubelet in later values.
POD_NAME_REF = "$(PDD_INSTANCE_ID)"


def pool_name(spec: PDDSpec, role: Component) -> str | None:
    """The spec field naming the role's node pool; the router runs on no GPU pool."""
    if role is Component.ROUTER:
        return None
    if role is Component.MAIN:
        return "remoteCluster" if spec.remote_cluster is not None else "poolB"
    return "poolA"


def resource_attributes(spec: PDDSpec, owner: Owner, role: Component, site: Site) -> str:
    """``OTEL_RESOURCE_ATTRIBUTES``: where the pod runs, as ``key=value,...``."""
    attributes = {
        "pdd.deployment": owner.name,
        "pdd.datacenter": datacenter(role),
        "pdd.pool": pool_name(spec, role),
        "k8s.namespace.name": site.namespace,
        "k8s.deployment.name": owner.child(role),
        "k8s.pod.name": POD_NAME_REF,
    }
    return ",".join(f"{key}={value}" for key, value in attributes.items() if value is not None)


def tracing_env(spec: PDDSpec, owner: Owner, role: Component, site: Site) -> list[dict[str, Any]]:
    """The pod's ``OTEL_*`` environment; none when tracing is off (the pod exports nothing)."""
    tracing = spec.observability.tracing
    if tracing is None:
        return []
    values = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": tracing.endpoint,
        "OTEL_TRACES_SAMPLER": SAMPLER,
        "OTEL_TRACES_SAMPLER_ARG": repr(tracing.sample_ratio),
        "OTEL_SERVICE_NAME": f"pdd-{role}",
        "OTEL_RESOURCE_ATTRIBUTES": resource_attributes(spec, owner, role, site),
    }
    return [{"name": name, "value": value} for name, value in values.items()]
