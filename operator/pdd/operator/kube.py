"""A small async Kubernetes API client for the children the operator writes.

kopf watches and patches the PDDDeployment itself; the children may live in another
cluster that kopf does not watch, so the operator reaches both clusters the same way:
plain HTTP from a ``kopf.ConnectionInfo`` (built by kopf's login for cluster A, from
the kubeconfig Secret for cluster B). Only the few kinds the operator owns are known.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx
import kopf

from pdd.operator.naming import API_VERSION, KIND, MANAGER, PLURAL, SPEC_HASH_ANNOTATION

#: kind -> (apiVersion, plural) of everything the operator reads or writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "Secret": ("v1", "secrets"),
    "Pod": ("v1", "pods"),
    "Service": ("v1", "services"),
    "Deployment": ("apps/v1", "deployments"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    KIND: (API_VERSION, PLURAL),
}

#: Seconds for one API request; the handlers retry on failure, so fail fast.
REQUEST_TIMEOUT_S = 30.0


class Outcome(StrEnum):
    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"


class ApiError(Exception):
    """A non-success answer from an API server, with its status code and message."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        self.status = status
        super().__init__(f"{method} {path} -> {status}: {message}")


@dataclass(frozen=True)
class ObjectPath:
    kind: str
    namespace: str
    name: str

    @property
    def collection(self) -> str:
        api_version, plural = RESOURCES[self.kind]
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        return f"{prefix}/namespaces/{self.namespace}/{plural}"

    @property
    def item(self) -> str:
        return f"{self.collection}/{self.name}"

    @classmethod
    def of(cls, obj: dict[str, Any]) -> ObjectPath:
        meta = obj["metadata"]
        return cls(obj["kind"], meta["namespace"], meta["name"])


class KubeApi:
    """get / apply / delete / patch_status against one API server."""

    def __init__(self, connection: kopf.ConnectionInfo) -> None:
        self.server = connection.server.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.server,
            headers=connection.as_http_headers(),
            verify=connection.as_ssl_context() if self.server.startswith("https") else True,
            timeout=REQUEST_TIMEOUT_S,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def get(self, path: ObjectPath) -> dict[str, Any] | None:
        response = await self._client.get(path.item)
        if response.status_code == 404:
            return None
        return _checked(response)

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """The objects of ``kind`` carrying ``labels`` (also filtered here: a server that
        ignores the selector still answers only what was asked)."""
        path = ObjectPath(kind, namespace, "")
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        response = await self._client.get(path.collection, params={"labelSelector": selector})
        items = _checked(response)
        return [
            item
            for item in items.get("items") or []
            if labels.items() <= (item.get("metadata", {}).get("labels") or {}).items()
        ]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        path = ObjectPath.of(obj)
        response = await self._client.post(path.collection, json=obj)
        return _checked(response)

    async def server_side_apply(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Apply ``obj`` as the operator's field manager; None if the server answered 404.

        Server-side apply also removes what an earlier apply set and this one omits
        (a dropped nodeSelector key), which a merge patch would leave behind.
        """
        path = ObjectPath.of(obj)
        response = await self._client.patch(
            path.item,
            params={"fieldManager": MANAGER, "force": "true"},
            json=obj,
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        if response.status_code == 404:
            return None
        return _checked(response)

    async def apply(self, obj: dict[str, Any]) -> Outcome:
        """Write ``obj`` (hash-annotated) only if the live object's hash differs."""
        path = ObjectPath.of(obj)
        live = await self.get(path)
        desired_hash = obj["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
        if live is None:
            await self.create(obj)
            return Outcome.CREATED
        if live["metadata"].get("annotations", {}).get(SPEC_HASH_ANNOTATION) == desired_hash:
            return Outcome.UNCHANGED
        if await self.server_side_apply(obj) is None:  # deleted meanwhile
            await self.create(obj)
            return Outcome.CREATED
        return Outcome.UPDATED

    async def delete(self, path: ObjectPath) -> bool:
        """Delete if present (background propagation); False when it was already gone."""
        if await self.get(path) is None:
            return False
        response = await self._client.request(
            "DELETE", path.item, json={"propagationPolicy": "Background"}
        )
        if response.status_code == 404:
            return False
        _checked(response)
        return True

    async def patch_status(self, path: ObjectPath, status: dict[str, Any]) -> None:
        response = await self._client.patch(
            f"{path.item}/status",
            json={"status": status},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        _checked(response)


def _checked(response: httpx.Response) -> dict[str, Any]:
    if response.is_success:
        return response.json()
    try:
        message = response.json().get("message", response.text)
    except ValueError:
        message = response.text
    raise ApiError(response.status_code, response.request.method, response.request.url.path,
                   message)  # fmt: skip
