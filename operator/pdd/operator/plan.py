"""The desired state of a PDDDeployment: every child, in which cluster, in write order.

``build_plan`` is pure: the reconciler fetches what it needs (the shared token), calls
this, and then only compares and writes. ``possible_children`` names every child that
any spec could produce, which is what pruning and deletion walk.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pdd.operator.builders.config import (
    build_config_map,
    build_shared_secret,
    build_worker_config,
    config_hash,
)
from pdd.operator.builders.deployments import (
    build_redis_deployment,
    build_router_deployment,
    build_worker_deployment,
)
from pdd.operator.builders.hpa import build_planner_hpa, build_relay_hpa
from pdd.operator.builders.meta import Site, with_spec_hash
from pdd.operator.builders.pdb import build_pdb
from pdd.operator.builders.services import (
    build_headless_service,
    build_redis_service,
    build_router_service,
    build_wan_service,
)
from pdd.operator.builders.wan_tls import (
    WanTlsMaterial,
    build_wan_tls_secret,
    generates_wan_tls,
)
from pdd.operator.naming import WAN_FACING_ROLES, WORKER_ROLES, Component, Owner
from pdd.operator.spec import PDDSpec


class Cluster(StrEnum):
    LOCAL = "local"  # cluster A, where the operator and the PDDDeployment live
    REMOTE = "remote"  # cluster B, reached through the kubeconfig Secret


@dataclass(frozen=True)
class ChildRef:
    cluster: Cluster
    kind: str
    namespace: str
    name: str


@dataclass(frozen=True)
class Plan:
    """Desired children (hash-annotated) in the order they must be written."""

    children: tuple[tuple[Cluster, dict[str, Any]], ...]

    def refs(self) -> set[ChildRef]:
        return {ref_of(cluster, obj) for cluster, obj in self.children}


def ref_of(cluster: Cluster, obj: dict[str, Any]) -> ChildRef:
    meta = obj["metadata"]
    return ChildRef(cluster, obj["kind"], meta["namespace"], meta["name"])


def remote_namespace(spec: PDDSpec, owner: Owner) -> str | None:
    if spec.remote_cluster is None:
        return None
    return spec.remote_cluster.namespace or owner.namespace


def build_plan(
    spec: PDDSpec, owner: Owner, token: str | None, wan_tls: WanTlsMaterial | None = None
) -> Plan:
    """Every child of a valid spec; MD's objects go to cluster B when remoteCluster is set.

    ``token`` and ``wan_tls``: the key material of the Secrets the operator generates once
    (the peers' shared token; the WAN TLS CA and certificate, where the spec turns TLS on
    without naming a Secret; the same material goes to both clusters). Without it, those
    Secrets are left out and the workloads still name them: a render's output, which
    must not hold fresh keys (``generated_secret_names`` lists what it references)."""
    local = Site(owner.namespace)
    remote_ns = remote_namespace(spec, owner)
    main_site = Site(remote_ns, remote=True) if remote_ns is not None else local
    main_cluster = Cluster.REMOTE if remote_ns is not None else Cluster.LOCAL

    local_config = build_worker_config(spec, owner, local)
    sites = [(Cluster.LOCAL, local)]
    if main_cluster is Cluster.REMOTE:
        sites.append((Cluster.REMOTE, main_site))
    children: list[tuple[Cluster, dict[str, Any]]] = []
    if token is not None:
        children += [(cluster, build_shared_secret(owner, site, token)) for cluster, site in sites]
    if generates_wan_tls(spec) and wan_tls is not None:
        children += [(c, build_wan_tls_secret(owner, site, wan_tls)) for c, site in sites]
    children.append((Cluster.LOCAL, build_config_map(owner, local, local_config)))
    main_config = local_config
    if main_cluster is Cluster.REMOTE:
        main_config = build_worker_config(spec, owner, main_site)
        children.append((Cluster.REMOTE, build_config_map(owner, main_site, main_config)))
    if spec.router.managed_redis:
        children += [
            (Cluster.LOCAL, build_redis_service(owner)),
            (Cluster.LOCAL, build_redis_deployment(spec, owner)),
        ]
    for role in WORKER_ROLES:
        cluster, site, cfg = (
            (main_cluster, main_site, main_config) if role is Component.MAIN
            else (Cluster.LOCAL, local, local_config)
        )  # fmt: skip
        if role in WAN_FACING_ROLES:
            children.append((cluster, build_wan_service(owner, role, site)))
        children += [
            (cluster, build_headless_service(owner, role, site)),
            (cluster, build_worker_deployment(spec, owner, role, site, config_hash(cfg))),
            (cluster, build_pdb(owner, role, site)),
        ]
        if spec.planner.enabled:
            children.append((cluster, build_planner_hpa(spec, owner, role, site)))
    if not spec.planner.enabled:
        children.append((Cluster.LOCAL, build_relay_hpa(spec, owner)))
    children += [
        (Cluster.LOCAL, build_router_service(owner)),
        (Cluster.LOCAL, build_router_deployment(spec, owner, config_hash(local_config))),
        (Cluster.LOCAL, build_pdb(owner, Component.ROUTER, local)),
    ]
    return Plan(tuple((cluster, with_spec_hash(obj)) for cluster, obj in children))


def generated_secret_names(spec: PDDSpec, owner: Owner) -> list[str]:
    """The Secrets the operator generates once and the workloads name (in each cluster)."""
    names = [owner.secret_name]
    if generates_wan_tls(spec):
        names.append(owner.wan_tls_secret_name)
    return names


def possible_children(owner: Owner, cluster: Cluster, namespace: str) -> list[ChildRef]:
    """Every child name any spec could create in ``cluster``, in deletion order
    (workloads first, so pods stop before their config and secret disappear)."""
    if cluster is Cluster.REMOTE:
        roles: tuple[Component, ...] = (Component.MAIN,)
    else:
        roles = (*WORKER_ROLES, Component.ROUTER, Component.REDIS)

    def ref(kind: str, name: str) -> ChildRef:
        return ChildRef(cluster, kind, namespace, name)

    refs = [ref("Deployment", owner.child(role)) for role in roles]
    refs += [ref("HorizontalPodAutoscaler", owner.child(r)) for r in roles if r in WORKER_ROLES]
    refs += [
        ref("PodDisruptionBudget", owner.child(role)) for role in roles if role != Component.REDIS
    ]
    refs += [ref("Service", owner.child(role)) for role in roles]
    refs += [ref("Service", owner.wan_service_name(r)) for r in roles if r in WAN_FACING_ROLES]
    refs += [ref("ConfigMap", owner.config_name), ref("Secret", owner.secret_name)]
    refs.append(ref("Secret", owner.wan_tls_secret_name))
    return refs
