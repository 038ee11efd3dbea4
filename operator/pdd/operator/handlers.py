"""kopf handlers: thin adapters from kopf's callbacks to the reconcile story.

Importing this module registers the handlers in kopf's default registry.
"""

from __future__ import annotations

from typing import Any

import kopf
from kubernetes_asyncio.config import ConfigException

from pdd.operator.builders.model_pull import MODEL_PULL_CONTAINER
from pdd.operator.cleanup import cleanup, cleanup_remote
from pdd.operator.kube import ApiError
from pdd.operator.naming import (
    COMPONENT_LABEL,
    FINALIZER,
    GROUP,
    OWNER_UID_LABEL,
    PLURAL,
    VERSION,
)
from pdd.operator.planner_loop import run_planner
from pdd.operator.planner_publish import serve
from pdd.operator.reconcile import owner_of, reconcile
from pdd.operator.roles import REPORTED_ROLES, refresh_readiness
from pdd.operator.runtime import OperatorOptions, OperatorRuntime
from pdd.operator.wakeups import next_poll_s, pull_snapshot, snapshot

#: kopf's own bookkeeping goes to annotations under this prefix.
ANNOTATIONS_PREFIX = "kopf.pdd.dev"
#: Seconds before kopf retries a handler that failed with an unexpected error (an API
#: hiccup); bad specs and unreachable clusters raise their own Permanent/TemporaryError.
RETRY_BACKOFF_S = 10.0


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Handler progress and the last-handled spec live in annotations: status belongs to
    # the CRD's structural schema, where kopf's default status.kopf would be pruned.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATIONS_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATIONS_PREFIX, key="last-handled-configuration"
    )
    # A finalizer named after us, so `kubectl get -o yaml` says who holds the object.
    settings.persistence.finalizer = FINALIZER
    # Ask the API server to end watches every 5 minutes: idle long-lived streams are
    # dropped silently by load balancers, and a fresh watch is cheap.
    settings.watching.server_timeout = 300
    # Replicas (``pdd operator --peering NAME``) meet in one ClusterKopfPeering even when
    # they serve a list of namespaces: no peering object to create in each of them.
    settings.peering.clusterwide = True
    runtime = memo.runtime = OperatorRuntime(memo.get("options", OperatorOptions()))
    port = runtime.options.planner_metrics_port
    if port is not None:
        runtime.planner_server = serve(
            runtime.planner_metrics, runtime.options.planner_metrics_host, port
        )


@kopf.on.login()
async def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo:
    """The ordinary resolution: the pod's service account in-cluster, else KUBECONFIG
    or ~/.kube/config, read by kubernetes_asyncio's loaders (tokens, client certificates,
    exec plugins, OIDC); kopf's watches get the same credentials as the operator's client.
    kopf calls this again when the API server refuses them: both are then renewed."""
    try:
        local = await memo.runtime.connect_local()
    except (ConfigException, OSError, ValueError) as exc:
        raise kopf.LoginError(f"no usable service account or kubeconfig: {exc}") from None
    return local.connection_info()


@kopf.on.resume(GROUP, VERSION, PLURAL, backoff=RETRY_BACKOFF_S)
@kopf.on.create(GROUP, VERSION, PLURAL, backoff=RETRY_BACKOFF_S)
async def reconcile_created(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    await reconcile(memo.runtime, body, logger)


@kopf.on.update(GROUP, VERSION, PLURAL, backoff=RETRY_BACKOFF_S)
async def reconcile_updated(
    body: kopf.Body, old: Any, memo: kopf.Memo, logger: Any, retry: int, **_: Any
) -> None:
    await reconcile(memo.runtime, body, logger)
    memo.runtime.wakeups.wake(owner_of(body).uid)  # the MD may have moved between clusters
    old_remote = ((old or {}).get("spec") or {}).get("remoteCluster")
    if old_remote and not (body.get("spec") or {}).get("remoteCluster"):
        # MD moved back into cluster A: the old cluster B objects have no owner to GC them.
        await cleanup_remote(memo.runtime, body, owner_of(body), old_remote, retry, logger)


@kopf.on.delete(GROUP, VERSION, PLURAL, backoff=RETRY_BACKOFF_S)
async def delete_everything(
    body: kopf.Body, memo: kopf.Memo, logger: Any, retry: int, **_: Any
) -> None:
    await cleanup(memo.runtime, body, owner_of(body), retry, logger)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5.0)
async def keep_readiness_fresh(
    body: kopf.Body, memo: kopf.Memo, logger: Any, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    """Children's readiness into status each time it may have changed: on cluster A's
    child Deployment events (below), and by polling, with backoff, for an MD in
    cluster B, which kopf cannot watch (wakeups.py says why)."""
    runtime: OperatorRuntime = memo.runtime
    owner = owner_of(body)
    runtime.wakeups.watch(owner.uid)
    poll_s: float | None = None
    last: Any = None
    try:
        while not stopped and not runtime.stopping:
            try:
                roles = await refresh_readiness(runtime, body, owner, logger)
            except ApiError as exc:  # transient (an unreachable cluster too): retry later
                logger.warning("could not refresh readiness: %s", exc)
                poll_s = runtime.options.status_interval_s
            else:
                poll_s = _next_poll_s(runtime.options, body, poll_s, roles != last)
                last = roles
            await runtime.wakeups.wait(owner.uid, stopped.wait(), poll_s)
    finally:
        runtime.wakeups.forget(owner.uid)


def _plans(spec: Any, **_: Any) -> bool:
    """A PDDDeployment with ``spec.planner.enabled``: only those run a planner."""
    return bool(((spec or {}).get("planner") or {}).get("enabled"))


@kopf.daemon(GROUP, VERSION, PLURAL, when=_plans, cancellation_timeout=5.0)
async def plan_replicas(
    body: kopf.Body, memo: kopf.Memo, logger: Any, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    """The SLO planner of one PDDDeployment (planner_loop.py); kopf stops it when
    ``spec.planner.enabled`` turns false or the object goes."""
    await run_planner(memo.runtime, body, owner_of(body), stopped, logger)


def _next_poll_s(
    options: OperatorOptions, body: kopf.Body, previous: float | None, changed: bool
) -> float | None:
    """None (wait for events) when every child is in cluster A; else when to poll B."""
    if not (body.get("spec") or {}).get("remoteCluster"):
        return None
    return next_poll_s(previous, changed, options.status_interval_s, options.status_interval_max_s)


def _reported(value: str | None, **_: Any) -> bool:
    """Whether a child Deployment's component is one status.roles reports: Redis's events
    would wake a refresh with nothing to report."""
    return value in REPORTED_ROLES


@kopf.on.event(
    "apps",
    "v1",
    "deployments",
    labels={OWNER_UID_LABEL: kopf.PRESENT, COMPONENT_LABEL: _reported},
)
async def child_deployment_changed(body: kopf.Body, event: Any, memo: kopf.Memo, **_: Any) -> None:
    """Cluster A's child Deployments, one watch for all PDDDeployments: a change in one's
    readiness wakes its owner's refresh."""
    meta = body["metadata"]
    seen = None if event.get("type") == "DELETED" else snapshot(dict(body))
    child = (meta["namespace"], meta["name"])
    memo.runtime.wakeups.child_changed(meta["labels"][OWNER_UID_LABEL], child, seen)


def _pulls_model(spec: Any, **_: Any) -> bool:
    """A pod with a model-pull init container: only those change ModelAvailable."""
    names = [c.get("name") for c in (spec or {}).get("initContainers") or []]
    return MODEL_PULL_CONTAINER in names


@kopf.on.event("", "v1", "pods", labels={OWNER_UID_LABEL: kopf.PRESENT}, when=_pulls_model)
async def model_pull_pod_changed(body: kopf.Body, event: Any, memo: kopf.Memo, **_: Any) -> None:
    """A pulling pod's init container changed (finished, failed): refresh its owner's
    status, which reads ModelAvailable from the pods."""
    meta = body["metadata"]
    seen = None if event.get("type") == "DELETED" else pull_snapshot(dict(body))
    child = ("pod", f"{meta['namespace']}/{meta['name']}")
    memo.runtime.wakeups.child_changed(meta["labels"][OWNER_UID_LABEL], child, seen)


@kopf.on.cleanup()
async def stop_daemons(memo: kopf.Memo, **_: Any) -> None:
    """Tell readiness daemons the operator is exiting: kopf can start one for an event it
    processes during shutdown, and that one would never see its own stop flag."""
    memo.runtime.stopping = True
    memo.runtime.wakeups.wake_all()
    await memo.runtime.aclose()
