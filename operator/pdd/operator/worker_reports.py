"""The KV shape the workers report: link sizing without ``model.config`` in the spec.

The operator never mounts the checkpoint, but every worker has loaded it, and its
``GET /health`` says the KV shape its engine got (``EngineInfo.kv_shape``: layers, KV
heads, head dim, dtype, bytes per token). When the spec gives no ``model.config``, the
operator asks a ready prefill pod for it and sizes the WAN link with that. Prefill is
the role to ask: its KV is what crosses the WAN, it runs in cluster A beside the
operator, and it serves plain HTTP (MD's API may be TLS across the WAN).

The pure parts (which pods to ask, what a health body says) are separate from the one
function that does I/O, so they are tested without a cluster or a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import httpx
from pydantic import ValidationError

from pdd.common.wire import WorkerHealth
from pdd.operator.kube import KubeApi
from pdd.operator.naming import COMPONENT_LABEL, OWNER_UID_LABEL, Component, Owner
from pdd.operator.spec import KVDtype, ModelShape, PDDSpec

#: A worker answers /health from its event loop at once; a slow one is skipped, not waited on.
HEALTH_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ReportedShape:
    """A KV shape one worker reported, and which pod reported it."""

    shape: ModelShape
    bytes_per_token: int
    pod: str


def needs_reported_shape(spec: PDDSpec) -> bool:
    """Whether the spec leaves the KV shape to the workers (no ``model.config``)."""
    return spec.model.config is None


def health_url(pod: dict[str, Any]) -> str | None:
    """``http://IP:PORT/health`` of a running, ready pod, or None (``pod_url``)."""
    return pod_url(pod, "/health")


def pod_url(pod: dict[str, Any], path: str) -> str | None:
    """``http://IP:PORT{path}`` of a running, ready pod (its container port named
    ``http``), or None for a pod not worth asking yet."""
    status = pod.get("status") or {}
    ip = status.get("podIP")
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    if status.get("phase") != "Running" or not ip or not ready:
        return None
    ports = [
        p.get("containerPort")
        for c in (pod.get("spec") or {}).get("containers") or []
        for p in c.get("ports") or []
        if p.get("name") == "http"
    ]
    if not ports:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{ports[0]}{path}"


def shape_from_health(body: Any) -> tuple[ModelShape, int] | None:
    """The KV shape (as ``model.config`` would give it) and bytes per token a worker's
    ``/health`` body reports, or None when it reports none (an older worker, a worker
    refusing its settings, a dtype the spec cannot express)."""
    try:
        health = WorkerHealth.model_validate(body)
    except ValidationError:
        return None
    kv = health.engine.kv_shape
    if kv is None or kv.dtype not in get_args(KVDtype):
        return None
    shape = ModelShape.model_validate(
        {"numLayers": kv.num_layers, "numKVHeads": kv.num_kv_heads, "headDim": kv.head_dim,
         "dtype": kv.dtype}
    )  # fmt: skip
    return shape, kv.bytes_per_token


def with_reported_shape(spec: PDDSpec, reported: ReportedShape | None) -> PDDSpec:
    """The spec to size with: as given, or with the reported shape as ``model.config``."""
    if reported is None or not needs_reported_shape(spec):
        return spec
    model = spec.model.model_copy(update={"config": reported.shape})
    return spec.model_copy(update={"model": model})


async def read_reported_shape(spec: PDDSpec, owner: Owner, api: KubeApi) -> ReportedShape | None:
    """Ask cluster A's ready prefill pods, in name order, for their KV shape; the first
    answer wins (every worker of a deployment loads the same checkpoint). None when the
    spec gives the shape or no pod has answered yet."""
    if not needs_reported_shape(spec):
        return None
    selector = {OWNER_UID_LABEL: owner.uid, COMPONENT_LABEL: str(Component.PREFILL)}
    pods = sorted(await api.list("Pod", owner.namespace, selector),
                  key=lambda p: p["metadata"]["name"])  # fmt: skip
    asked = [(pod["metadata"]["name"], url) for pod in pods if (url := health_url(pod))]
    if not asked:
        return None
    async with httpx.AsyncClient() as http:
        for name, url in asked:
            try:
                response = await http.get(url, timeout=HEALTH_TIMEOUT_S)
                body = response.json() if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                continue
            found = shape_from_health(body)
            if found is not None:
                return ReportedShape(found[0], found[1], name)
    return None
