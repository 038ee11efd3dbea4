"""An in-memory Kubernetes API (kmock's emulator) for running kopf operators in-process.

Shared by the operator's integration tests and its scale bench, so both run the operator
the same way: kopf in its own thread and event loop, objects created through the
emulator's HTTP API so watches fire, every request recorded (``list(k8s)``) for
counting. The emulator has no controllers and assigns no uids: callers set uids and play
the Deployment controller by patching status where they need readiness.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import jsonpatch
import kmock
import kopf
import yaml

from pdd.testing.waiting import until

CR = "pdd.dev/v1alpha1/pdddeployments"
DEPLOYMENTS = "apps/v1/deployments"
HPAS = "autoscaling/v2/horizontalpodautoscalers"
PODS = "v1/pods"  # what a huggingFace model source's pull reports through
CHILD_RESOURCES = {
    "v1/configmaps": "ConfigMap",
    "v1/secrets": "Secret",
    "v1/services": "Service",
    DEPLOYMENTS: "Deployment",
    HPAS: "HorizontalPodAutoscaler",
    "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
}
VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]
RESOURCE_VERSIONS = itertools.count(1)
#: The request the current task is serving, if any (see VersionedEmulator.__iter__).
SERVING: ContextVar[Any] = ContextVar("serving", default=None)


class VersionedEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what kopf's optimistic concurrency needs from a server:
    an increasing resourceVersion on every write, and 422 (not 500) when a JSON patch's
    resourceVersion test fails, so kopf retries on the next event instead of looping;
    and a cost per request that does not grow with the requests served before it.
    """

    def __iter__(self) -> Iterator[Any]:
        """Every request served so far, except to the request being served: it is matched
        against the reactions by asking each reaction's view whether it contains it, which
        kmock answers by scanning the whole log, making N requests cost O(N^2) (10
        PDDDeployments took minutes, 100 never finished). Seen alone, it matches exactly
        the views that filter for it, which is all this emulator has (no sliced views)."""
        serving = SERVING.get()
        if serving is not None:
            yield serving
        else:
            yield from super().__iter__()

    async def _handle(self, request: Any) -> Any:
        SERVING.set(request)  # in this request's own task: other tasks still see the log
        if request.resource is not None and request.action in (
            kmock.action.CREATE,
            kmock.action.UPDATE,
        ):
            version = str(next(RESOURCE_VERSIONS))
            if isinstance(request.data, dict):
                request.data.setdefault("metadata", {})["resourceVersion"] = version
            elif isinstance(request.data, list):  # a JSON patch
                op = {"op": "add", "path": "/metadata/resourceVersion", "value": version}
                request.data.append(op)
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None


@asynccontextmanager
async def emulator() -> AsyncIterator[tuple[kmock.KubernetesEmulator, str]]:
    """One cluster: the emulator knowing the PDDDeployment CRD and its children's kinds,
    served over HTTP; yields it and its URL."""
    async with VersionedEmulator() as k8s, kmock.Server(k8s) as server:
        k8s.resources["v1/namespaces"] = {"kind": "Namespace", "namespaced": False, "verbs": VERBS}
        k8s.resources["v1/events"] = {"kind": "Event", "namespaced": True, "verbs": VERBS}
        k8s.resources[PODS] = {"kind": "Pod", "namespaced": True, "verbs": VERBS}
        for resource, kind in CHILD_RESOURCES.items():
            k8s.resources[resource] = {"kind": kind, "namespaced": True, "verbs": VERBS}
        k8s.resources[CR] = {
            "kind": "PDDDeployment",
            "singular": "pdddeployment",
            "namespaced": True,
            "verbs": VERBS,
            "subresources": ["status"],
        }
        yield k8s, str(server.url).rstrip("/")


def kubeconfig(url: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emulator",
            "contexts": [{"name": "emulator", "context": {"cluster": "c", "user": "u"}}],
            "clusters": [{"name": "c", "cluster": {"server": url}}],
            "users": [{"name": "u", "user": {"token": "test-token"}}],
        }
    )


def live(k8s: kmock.KubernetesEmulator, resource: str, ns: str, name: str) -> dict | None:
    try:
        obj = k8s.objects[resource, ns, name]
    except KeyError:
        return None
    return None if obj.deleted else obj.raw


def condition(obj: dict | None, type_: str) -> dict:
    """The condition of that type in ``obj``'s status, or {} if it has none yet."""
    for c in ((obj or {}).get("status") or {}).get("conditions", []):
        if c["type"] == type_:
            return c
    return {}


def watching(k8s: kmock.KubernetesEmulator, since: int) -> bool:
    return any(
        r.resource is not None and r.resource.plural == "pdddeployments" and r.params.get("watch")
        for r in list(k8s)[since:]
    )


@asynccontextmanager
async def running_operator(
    k8s: kmock.KubernetesEmulator, memo: kopf.Memo, name: str = "kopf", **peering: Any
) -> AsyncIterator[None]:
    """The operator as `pdd operator` runs it (handlers already registered by importing
    them), in its own thread and event loop (kopf treats every task created in its loop
    as its own and would cancel the emulator's), until the block ends.

    Yields once kopf watches PDDDeployments, so objects created next arrive as watch
    events (the emulator would otherwise list and replay them, and kopf would see stale
    duplicates that a real API server never sends). ``peering``: kopf's peering options
    (``peering_options`` of ``pdd operator --peering``); the caller decides when it is up.
    """
    stop = threading.Event()
    since = len(list(k8s))
    operator = kopf.operator(
        clusterwide=True, stop_flag=stop, memo=memo, **(peering or {"standalone": True})
    )
    thread = threading.Thread(target=asyncio.run, args=(operator,), name=name)
    thread.start()
    try:
        if not peering:
            await until(lambda: watching(k8s, since), "kopf to watch PDDDeployments")
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive(), "the operator did not stop"
