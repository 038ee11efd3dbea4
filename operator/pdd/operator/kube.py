"""The operator's client for the children it writes, in cluster A and in cluster B.

kopf watches and patches the PDDDeployment itself; the children may live in another
cluster that kopf does not watch, so the operator reaches both clusters the same way,
through kubernetes_asyncio (the maintained asyncio client): its loaders read kubeconfigs
as kubectl does (tokens, client certificates, exec credential plugins such as the cloud
CLIs of EKS, GKE and AKS, OIDC) and the in-cluster service account. ``KubeApi`` only adds
what the operator needs on top: get / create / server-side apply / delete / status
patch by object path, for the few kinds the operator owns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import aiohttp
import kopf
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config import ConfigException, load_kube_config
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader
from kubernetes_asyncio.config.kube_config import KubeConfigLoader

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

#: Where Kubernetes mounts a pod's service account (token, ca.crt, namespace).
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
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


class ApiUnreachable(ApiError):
    """No answer at all (connection refused, TLS failure, timeout): status 0."""

    def __init__(self, method: str, path: str, cause: BaseException) -> None:
        super().__init__(0, method, path, f"no answer from the API server ({cause!r})")


class KubeconfigError(ValueError):
    """A kubeconfig the client library cannot use; the message says what is wrong."""


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

    def __init__(self, client: ApiClient, credentials: ExecCredentials | None = None) -> None:
        self._client = client
        self._credentials = credentials
        self.server: str = client.configuration.host or ""

    @classmethod
    async def from_kubeconfig(cls, config: dict[str, Any]) -> KubeApi:
        """A client for a kubeconfig's current context (cluster B's, from its Secret).

        The library's loader reads every kind of user (token, client certificate, exec
        plugin, OIDC, basic auth); an exec plugin is run again when its credential
        expires, and once more when the server refuses it (401), as kubectl does."""
        configuration = Configuration()
        try:
            loader = KubeConfigLoader(config_dict=config, config_base_path=None)
            await loader.load_and_set(configuration)
        except (ConfigException, KeyError, TypeError, ValueError, OSError) as exc:
            raise KubeconfigError(f"{type(exc).__name__}: {exc}") from None
        credentials = None
        if loader._user is not None and "exec" in loader._user:
            credentials = ExecCredentials(loader)
            configuration.refresh_api_key_hook = credentials.renew_if_expired
        elif loader.provider:  # an auth provider (OIDC): the loader refreshes its token
            configuration.refresh_api_key_hook = loader.load_and_set
        return cls(ApiClient(configuration), credentials)

    @classmethod
    async def local(
        cls,
        service_account: Path = SERVICE_ACCOUNT_DIR,
        environ: Mapping[str, str] = os.environ,
    ) -> KubeApi:
        """A client for the cluster the operator runs in: the pod's service account
        in-cluster (its projected token re-read as kubelet rotates it), else KUBECONFIG
        (read now, not at import) or ~/.kube/config."""
        configuration = Configuration()
        token = service_account / "token"
        if environ.get("KUBERNETES_SERVICE_HOST") and token.is_file():
            ca = str(service_account / "ca.crt")
            loader = InClusterConfigLoader(str(token), ca, environ=dict(environ))
            loader.load_and_set(configuration)
        else:
            path = environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
            await load_kube_config(
                config_file=path, client_configuration=configuration, persist_config=False
            )
        return cls(ApiClient(configuration))

    def connection_info(self) -> kopf.ConnectionInfo:
        """The same credentials for kopf's watches, so both resolve the cluster one way."""
        configuration = self._client.configuration
        scheme, _, token = (configuration.api_key.get("BearerToken") or "").partition(" ")
        return kopf.ConnectionInfo(
            server=self.server,
            ca_path=configuration.ssl_ca_cert,
            insecure=not configuration.verify_ssl,
            scheme=scheme or None,
            token=token or None,
            certificate_path=configuration.cert_file,
            private_key_path=configuration.key_file,
        )

    async def aclose(self) -> None:
        await self._client.close()

    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, dict[str, Any] | None]:
        """One call through the library's client (its auth, TLS and token renewal); the
        status and the decoded body, whatever the status."""
        status, data, text = await self._call(method, path, body, query, content_type)
        if status == 401 and self._credentials is not None:  # refused before it expired
            await self._credentials.renew(self._client.configuration)
            status, data, text = await self._call(method, path, body, query, content_type)
        if 200 <= status < 300 or status == 404:
            return status, data
        message = data.get("message", text) if isinstance(data, dict) else text
        raise ApiError(status, method, path, message)

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        query: list[tuple[str, str]] | None,
        content_type: str,
    ) -> tuple[int, Any, str]:
        try:
            response = await self._client.call_api(
                path,
                method,
                query_params=query or [],
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            async with response:
                text = await response.text()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise ApiUnreachable(method, path, exc) from None
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = None
        return response.status, data, text

    async def get(self, path: ObjectPath) -> dict[str, Any] | None:
        status, data = await self._request("GET", path.item)
        return None if status == 404 else data

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """The objects of ``kind`` carrying ``labels`` (also filtered here: a server that
        ignores the selector still answers only what was asked)."""
        path = ObjectPath(kind, namespace, "")
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        status, data = await self._request(
            "GET", path.collection, query=[("labelSelector", selector)]
        )
        if status == 404 or data is None:
            return []
        return [
            item
            for item in data.get("items") or []
            if labels.items() <= (item.get("metadata", {}).get("labels") or {}).items()
        ]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        path = ObjectPath.of(obj)
        status, data = await self._request("POST", path.collection, body=obj)
        if status == 404:
            raise ApiError(404, "POST", path.collection, "no such collection (namespace?)")
        return data or {}

    async def server_side_apply(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Apply ``obj`` as the operator's field manager; None if the server answered 404.

        Server-side apply also removes what an earlier apply set and this one omits
        (a dropped nodeSelector key), which a merge patch would leave behind.
        """
        path = ObjectPath.of(obj)
        status, data = await self._request(
            "PATCH",
            path.item,
            body=obj,
            query=[("fieldManager", MANAGER), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )
        return None if status == 404 else data

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
        body = {"propagationPolicy": "Background"}
        status, _ = await self._request("DELETE", path.item, body=body)
        return status != 404

    async def patch_status(self, path: ObjectPath, status: dict[str, Any]) -> None:
        code, _ = await self._request(
            "PATCH",
            f"{path.item}/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )
        if code == 404:
            raise ApiError(404, "PATCH", f"{path.item}/status", "not found")


class ExecCredentials:
    """An exec plugin's credential, renewed by running the plugin again: when its
    ``expirationTimestamp`` has passed (before the request), or when the server refused
    it (a 401; a credential without an expiry is kept until then)."""

    def __init__(self, loader: KubeConfigLoader) -> None:
        self._loader = loader

    async def renew_if_expired(self, configuration: Configuration) -> None:
        if hasattr(self._loader, "exec_plugin_expiry"):  # the loader re-runs it if expired
            await self._loader.load_from_exec_plugin()
            self._set(configuration)

    async def renew(self, configuration: Configuration) -> None:
        if hasattr(self._loader, "exec_plugin_expiry"):
            del self._loader.exec_plugin_expiry
        await self._loader.load_from_exec_plugin()
        self._set(configuration)

    def _set(self, configuration: Configuration) -> None:
        token = getattr(self._loader, "token", None)
        if token is not None:  # a plugin that gives a client certificate sets no token
            configuration.api_key["BearerToken"] = token
