"""The reconcile story: validate, reach cluster B, plan, write the differences, report.

Nothing is written before the spec is known to be valid and cluster B is reachable,
so a bad or not-yet-deployable spec leaves no half-built deployment behind.
"""

from __future__ import annotations

import base64
import logging
from collections import Counter
from typing import Any

import kopf

from pdd.common.wan_tls import TLS_FILES
from pdd.operator.builders.config import new_shared_token
from pdd.operator.builders.wan_tls import WanTlsMaterial, generates_wan_tls, new_wan_tls, wan_tls_of
from pdd.operator.conditions import Condition
from pdd.operator.default_tracing import with_default_tracing
from pdd.operator.kube import KubeApi, ObjectPath, Outcome
from pdd.operator.naming import SHARED_SECRET_KEY, Owner
from pdd.operator.plan import Cluster, Plan, build_plan, possible_children
from pdd.operator.readiness import public_roles, readiness_conditions
from pdd.operator.remote import RemoteClusterUnavailable
from pdd.operator.roles import read_model_condition, read_roles
from pdd.operator.runtime import OperatorRuntime
from pdd.operator.sizing import kv_capacity, size_link
from pdd.operator.spec import PDDSpec
from pdd.operator.status import write_status
from pdd.operator.validation import InvalidSpecError, parse_spec
from pdd.operator.worker_reports import read_reported_shape

HEALTHY = Condition("Degraded", "False", "AsExpected", "spec is valid and every child is written")


def owner_of(body: kopf.Body) -> Owner:
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


async def reconcile(runtime: OperatorRuntime, body: kopf.Body, logger: logging.Logger) -> None:
    """Bring the children of one PDDDeployment to its spec (idempotent)."""
    owner = owner_of(body)
    api = runtime.api
    try:
        raw = with_default_tracing(dict(body.get("spec") or {}), runtime.options.default_tracing)
        spec = parse_spec(raw, owner.name)
    except InvalidSpecError as exc:
        await _report_blocked(runtime, owner, "InvalidSpec", str(exc))
        kopf.warn(body, reason="InvalidSpec", message=str(exc))
        raise kopf.PermanentError(f"invalid spec, nothing created: {exc}") from None
    remote = await _remote_or_retry(runtime, body, owner, spec)
    token = await _shared_token(api, owner)
    wan_tls = await _wan_tls(runtime, body, owner, spec, remote)
    plan = build_plan(spec, owner, token, wan_tls)
    outcomes = await _apply(plan, api, remote)
    await _prune(plan, owner, api)
    reported = await read_reported_shape(spec, owner, api)
    report = size_link(spec, reported)
    if report.undersized:
        kopf.warn(body, reason="LinkUndersized", message=report.condition.message)
    written = ", ".join(f"{n} {o}" for o, n in outcomes.items() if o is not Outcome.UNCHANGED)
    if written:
        logger.info("children written: %s", written)
        kopf.info(body, reason="Reconciled", message=f"children written: {written}")
    roles = await read_roles(spec, owner, api, remote)
    model = await read_model_condition(spec, owner, api, remote)

    def compute(_: dict[str, Any], generation: int) -> tuple[dict[str, Any], list[Condition]]:
        fields = {
            "observedGeneration": generation,
            "wan": report.wan,
            "engine": kv_capacity(spec, reported),
            "roles": public_roles(roles),
        }
        return fields, [report.condition, HEALTHY, *readiness_conditions(roles), *model]

    async with runtime.lock(owner.uid):
        await write_status(api, owner.namespace, owner.name, compute)


async def _remote_or_retry(
    runtime: OperatorRuntime, body: kopf.Body, owner: Owner, spec: PDDSpec
) -> KubeApi | None:
    """Cluster B's client, or a retry later (and a condition saying why) if unreachable."""
    if spec.remote_cluster is None:
        return None
    try:
        return await runtime.remotes.get(
            runtime.api, owner.namespace, spec.remote_cluster.kubeconfig_secret
        )
    except RemoteClusterUnavailable as exc:
        await _report_blocked(runtime, owner, "RemoteClusterUnavailable", str(exc))
        kopf.warn(body, reason="RemoteClusterUnavailable", message=str(exc))
        raise kopf.TemporaryError(str(exc), delay=runtime.options.remote_retry_delay_s) from None


async def _report_blocked(
    runtime: OperatorRuntime, owner: Owner, reason: str, message: str
) -> None:
    """Degraded=True and Ready=False with the fix in the message; nothing else changes."""
    conditions = [
        Condition("Degraded", "True", reason, message),
        Condition("Ready", "False", reason, message),
        Condition("Progressing", "False", reason, "blocked until the problem above is fixed"),
    ]
    async with runtime.lock(owner.uid):
        await write_status(
            runtime.api,
            owner.namespace,
            owner.name,
            lambda _, generation: ({"observedGeneration": generation}, conditions),
        )


async def _shared_token(api: KubeApi, owner: Owner) -> str:
    """The peers' shared secret: read back if it exists, generated once otherwise."""
    secret = await api.get(ObjectPath("Secret", owner.namespace, owner.secret_name))
    encoded = ((secret or {}).get("data") or {}).get(SHARED_SECRET_KEY)
    if encoded:
        return base64.b64decode(encoded).decode()
    return new_shared_token()


async def _wan_tls(
    runtime: OperatorRuntime, body: kopf.Body, owner: Owner, spec: PDDSpec, remote: KubeApi | None
) -> WanTlsMaterial | None:
    """The generated WAN TLS material (read back, else generated once), or None where the
    operator generates none. A user's Secret that is missing or lacks a key in either
    cluster blocks the reconcile with a condition naming it (pods would not start)."""
    tls = spec.wan.tls
    if generates_wan_tls(spec):
        path = ObjectPath("Secret", owner.namespace, owner.wan_tls_secret_name)
        return wan_tls_of(await runtime.api.get(path)) or new_wan_tls(owner.name)
    if tls.enabled and tls.secret_name is not None:
        sites = [("cluster A", runtime.api, owner.namespace)]
        if remote is not None and spec.remote_cluster is not None:
            sites.append(("cluster B", remote, spec.remote_cluster.namespace or owner.namespace))
        for where, api, namespace in sites:
            secret = await api.get(ObjectPath("Secret", namespace, tls.secret_name))
            data = (secret or {}).get("data") or {}
            missing = [key for key in TLS_FILES if not data.get(key)]
            if secret is None or missing:
                problem = "does not exist" if secret is None else f"lacks {', '.join(missing)}"
                message = (
                    f"wan.tls.secretName: Secret {namespace}/{tls.secret_name} in {where} "
                    f"{problem}; it needs {', '.join(TLS_FILES)} (cert-manager's layout)"
                )
                await _report_blocked(runtime, owner, "WanTlsSecretInvalid", message)
                kopf.warn(body, reason="WanTlsSecretInvalid", message=message)
                raise kopf.TemporaryError(message, delay=runtime.options.remote_retry_delay_s)
    return None


async def _apply(plan: Plan, local: KubeApi, remote: KubeApi | None) -> Counter[Outcome]:
    outcomes: Counter[Outcome] = Counter()
    for cluster, obj in plan.children:
        api = local if cluster is Cluster.LOCAL else remote
        if api is None:
            raise RuntimeError("a cluster B child was planned without a cluster B client")
        outcomes[await api.apply(obj)] += 1
    return outcomes


async def _prune(plan: Plan, owner: Owner, local: KubeApi) -> None:
    """Delete cluster A children the spec no longer asks for (MD moved to cluster B,
    managed Redis switched off)."""
    wanted = plan.refs()
    for ref in possible_children(owner, Cluster.LOCAL, owner.namespace):
        if ref not in wanted:
            await local.delete(ObjectPath(ref.kind, ref.namespace, ref.name))
