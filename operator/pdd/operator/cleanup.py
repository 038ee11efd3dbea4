"""Deletion: remove every child in both clusters before the finalizer is released.

Cluster A children would also go by garbage collection (they carry owner references);
deleting them here makes the order explicit (workloads before their config). Cluster B
children have no owner references at all: without this, they would live forever.
"""

from __future__ import annotations

import logging

import kopf
from pydantic import ValidationError

from pdd.operator.kube import KubeApi, ObjectPath
from pdd.operator.naming import OWNER_UID_LABEL, Owner
from pdd.operator.plan import ChildRef, Cluster, possible_children
from pdd.operator.remote import RemoteClusterUnavailable
from pdd.operator.runtime import OperatorRuntime
from pdd.operator.spec import RemoteCluster


async def delete_children(api: KubeApi, refs: list[ChildRef]) -> int:
    """Delete every child that exists; returns how many were deleted."""
    deleted = 0
    for ref in refs:
        deleted += await api.delete(ObjectPath(ref.kind, ref.namespace, ref.name))
    return deleted


async def cleanup_remote(
    runtime: OperatorRuntime,
    body: kopf.Body,
    owner: Owner,
    raw_remote: dict | None,
    retry: int,
    logger: logging.Logger,
) -> None:
    """Delete the children in cluster B described by a (possibly old) remoteCluster spec.

    While cluster B is unreachable this retries a few times, then gives up with a
    Warning event naming the leftovers, so a dead cluster cannot block deletion forever.
    """
    if not raw_remote:
        return
    try:
        remote_spec = RemoteCluster.model_validate(raw_remote)
    except ValidationError:
        logger.warning("remoteCluster is not valid; no cluster B objects can exist to delete")
        return
    namespace = remote_spec.namespace or owner.namespace
    try:
        remote = await runtime.remotes.get(
            runtime.api, owner.namespace, remote_spec.kubeconfig_secret
        )
    except RemoteClusterUnavailable as exc:
        if retry < runtime.options.remote_cleanup_retries:
            raise kopf.TemporaryError(
                str(exc), delay=runtime.options.remote_retry_delay_s
            ) from None
        kopf.warn(
            body,
            reason="RemoteCleanupSkipped",
            message=f"{exc}; delete the leftovers in cluster B yourself: kubectl -n {namespace} "
            f"delete deploy,svc,pdb,cm,secret -l {OWNER_UID_LABEL}={owner.uid}",
        )
        return
    deleted = await delete_children(remote, possible_children(owner, Cluster.REMOTE, namespace))
    logger.info("deleted %d children in cluster B", deleted)


async def cleanup(
    runtime: OperatorRuntime, body: kopf.Body, owner: Owner, retry: int, logger: logging.Logger
) -> None:
    spec = body.get("spec") or {}
    await cleanup_remote(runtime, body, owner, spec.get("remoteCluster"), retry, logger)
    local_refs = possible_children(owner, Cluster.LOCAL, owner.namespace)
    deleted = await delete_children(runtime.api, local_refs)
    logger.info("deleted %d children in cluster A", deleted)
    runtime.forget(owner.uid)
