"""Services: one headless Service per worker role, a ClusterIP for the router and Redis.

Worker Services are headless because the router and the peers need every instance's
address (prefix-cache locality is per pod), not a load-balanced virtual IP. The roles
peers reach across the WAN (RLD, MD) get a second headless Service, ``<name>-<role>-wan``,
with only their WAN data port: the one to export to cluster B (a multi-cluster
ServiceExport, a LoadBalancer of your own) and to admit in a NetworkPolicy, while the
HTTP and in-datacenter data ports stay inside the cluster.
"""

from __future__ import annotations

from typing import Any

from pdd.operator.builders.meta import Site, metadata
from pdd.operator.naming import (
    REDIS_PORT,
    ROUTER_PORT,
    WORKER_HTTP_PORT,
    WORKER_KV_PORT,
    WORKER_WAN_PORT,
    Component,
    Owner,
)


def build_headless_service(owner: Owner, role: Component, site: Site) -> dict[str, Any]:
    ports = [
        {"name": "http", "port": WORKER_HTTP_PORT, "targetPort": "http"},
        {"name": "kv", "port": WORKER_KV_PORT, "targetPort": "kv"},
    ]
    return _service(owner, role, site, {"clusterIP": "None", "ports": ports})


def build_wan_service(owner: Owner, role: Component, site: Site) -> dict[str, Any]:
    ports = [{"name": "wan", "port": WORKER_WAN_PORT, "targetPort": "wan"}]
    service = _service(owner, role, site, {"clusterIP": "None", "ports": ports})
    service["metadata"]["name"] = owner.wan_service_name(role)
    return service


def build_router_service(owner: Owner) -> dict[str, Any]:
    """The front door clients call (expose it with an Ingress or Gateway of your own)."""
    ports = [{"name": "http", "port": ROUTER_PORT, "targetPort": "http"}]
    return _service(
        owner, Component.ROUTER, Site(owner.namespace), {"type": "ClusterIP", "ports": ports}
    )


def build_redis_service(owner: Owner) -> dict[str, Any]:
    ports = [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis"}]
    return _service(
        owner, Component.REDIS, Site(owner.namespace), {"type": "ClusterIP", "ports": ports}
    )


def _service(owner: Owner, role: Component, site: Site, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, role, owner.child(role), site),
        "spec": {**spec, "selector": owner.selector_labels(role)},
    }
