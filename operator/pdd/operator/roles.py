"""Reading the children's readiness back into status (kept fresh by a kopf daemon that
their events wake, see wakeups.py)."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from pdd.operator.builders.deployments import worker_replicas
from pdd.operator.builders.model_pull import pulls_model
from pdd.operator.conditions import Condition
from pdd.operator.kube import ApiError, KubeApi, ObjectPath
from pdd.operator.model_status import model_condition
from pdd.operator.naming import OWNER_UID_LABEL, WORKER_ROLES, Component, Owner
from pdd.operator.plan import remote_namespace
from pdd.operator.readiness import public_roles, readiness_conditions, role_status
from pdd.operator.remote import RemoteClusterUnavailable
from pdd.operator.runtime import OperatorRuntime
from pdd.operator.sizing import kv_capacity, size_link
from pdd.operator.spec import PDDSpec
from pdd.operator.status import write_status
from pdd.operator.validation import InvalidSpecError, parse_spec
from pdd.operator.worker_reports import needs_reported_shape, read_reported_shape

#: The roles whose Deployments status.roles reports (Redis's is not one of them).
REPORTED_ROLES = (*WORKER_ROLES, Component.ROUTER)


def desired_replicas(spec: PDDSpec, role: Component) -> int:
    if role is Component.ROUTER:
        return spec.router.replicas
    replicas = worker_replicas(spec, role)
    return spec.relay.min_replicas if replicas is None else replicas


async def read_roles(
    spec: PDDSpec, owner: Owner, local: KubeApi, remote: KubeApi | None
) -> dict[str, dict[str, Any]]:
    """Desired vs ready replicas of each role, from the Deployments in both clusters."""
    roles: dict[str, dict[str, Any]] = {}
    remote_ns = remote_namespace(spec, owner)
    for role in REPORTED_ROLES:
        if role is Component.MAIN and remote is not None and remote_ns is not None:
            api, namespace = remote, remote_ns  # main decode lives in cluster B
        else:
            api, namespace = local, owner.namespace
        deployment = await api.get(ObjectPath("Deployment", namespace, owner.child(role)))
        roles[str(role)] = role_status(desired_replicas(spec, role), deployment)
    return roles


async def read_model_condition(
    spec: PDDSpec, owner: Owner, local: KubeApi, remote: KubeApi | None
) -> list[Condition]:
    """ModelAvailable from the pods that pull the model (both clusters), if any do."""
    if not pulls_model(spec):
        return []
    selector = {OWNER_UID_LABEL: owner.uid}
    pods = await local.list("Pod", owner.namespace, selector)
    remote_ns = remote_namespace(spec, owner)
    if remote is not None and remote_ns is not None:
        try:
            pods += await remote.list("Pod", remote_ns, selector)
        except ApiError as exc:  # cluster B's Role may not grant pods: A's pods still tell
            if exc.status != 403:
                raise
    condition = model_condition(spec, pods)
    return [] if condition is None else [condition]


async def refresh_readiness(
    runtime: OperatorRuntime, body: kopf.Body, owner: Owner, logger: logging.Logger
) -> dict[str, dict[str, Any]] | None:
    """Write status.roles and the Ready/Progressing conditions from the live children;
    return the roles read (None when there was nothing to read).

    Invalid or not-yet-reachable specs are left to the reconcile handler, which has
    already written why; this only reports on deployments that could be built.
    """
    try:
        spec = parse_spec(dict(body.get("spec") or {}), owner.name)
        remote = None
        if spec.remote_cluster is not None:
            ref = spec.remote_cluster.kubeconfig_secret
            remote = await runtime.remotes.get(runtime.api, owner.namespace, ref)
    except (InvalidSpecError, RemoteClusterUnavailable) as exc:
        logger.debug("readiness not refreshed: %s", exc)
        return None
    roles = await read_roles(spec, owner, runtime.api, remote)
    model = await read_model_condition(spec, owner, runtime.api, remote)
    # Without model.config the link is sized from what a ready prefill pod reports: a
    # change in P's readiness (what wakes this) is when that becomes possible.
    sized: dict[str, Any] = {}
    link: list[Condition] = []
    if needs_reported_shape(spec):
        reported = await read_reported_shape(spec, owner, runtime.api)
        if reported is not None:
            report = size_link(spec, reported)
            sized = {"wan": report.wan, "engine": kv_capacity(spec, reported)}
            link = [report.condition]

    def compute(current: dict[str, Any], _: int) -> tuple[dict[str, Any], list[Condition]]:
        degraded: dict[str, Any] = next(
            (c for c in current.get("conditions", []) if c.get("type") == "Degraded"), {}
        )
        if degraded.get("status") == "True":  # the reconcile handler's verdict stands
            return {}, []
        fields = {"roles": public_roles(roles), **sized}
        return fields, [*readiness_conditions(roles), *model, *link]

    async with runtime.lock(owner.uid):
        await write_status(runtime.api, owner.namespace, owner.name, compute)
    return roles
