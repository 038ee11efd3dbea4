"""The remote cluster B: a client built from the kubeconfig stored in a Secret.

The kubeconfig is read by kubernetes_asyncio's loader (``KubeApi.from_kubeconfig``), so
whatever kubectl accepts works here: a ServiceAccount token, a client certificate, an
exec credential plugin (``aws eks get-token``, ``gke-gcloud-auth-plugin``, ``kubelogin``;
its command must exist in the operator's image, with the plugin's own credentials, such
as workload identity, available to the operator pod), or OIDC.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib

import yaml

from pdd.operator.kube import KubeApi, KubeconfigError, ObjectPath
from pdd.operator.spec import SecretKeyRef


class RemoteClusterUnavailable(Exception):
    """Cluster B cannot be reached yet (missing Secret or key, unusable kubeconfig)."""


async def client_from_kubeconfig(text: str) -> KubeApi:
    """A client for the kubeconfig's current context; RemoteClusterUnavailable, saying
    what is wrong and how to make a usable one, when the library cannot load it."""
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RemoteClusterUnavailable(f"the kubeconfig is not YAML ({exc})") from None
    if not isinstance(config, dict) or not config.get("current-context"):
        raise RemoteClusterUnavailable(
            "the kubeconfig has no current-context; export a self-contained one with "
            "`kubectl config view --minify --flatten`"
        )
    try:
        return await KubeApi.from_kubeconfig(config)
    except KubeconfigError as exc:
        raise RemoteClusterUnavailable(
            f"the kubeconfig's current context cannot be used ({exc}); export a "
            "self-contained one with `kubectl config view --minify --flatten` (an exec "
            "plugin's command must be in the operator's image)"
        ) from None


class RemoteClients:
    """Clients for cluster B, one per kubeconfig Secret, rebuilt when its content changes."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, str, str], tuple[str, KubeApi]] = {}
        #: One build at a time per Secret: the reconcile and the readiness daemon ask
        #: together, and a second build would run the exec plugin twice and leak a client.
        self._building: dict[tuple[str, str, str], asyncio.Lock] = {}

    async def get(self, local: KubeApi, namespace: str, ref: SecretKeyRef) -> KubeApi:
        secret = await local.get(ObjectPath("Secret", namespace, ref.name))
        if secret is None:
            raise RemoteClusterUnavailable(
                f"Secret {namespace}/{ref.name} with the cluster B kubeconfig does not exist; "
                f"create it: kubectl -n {namespace} create secret generic {ref.name} "
                f"--from-file={ref.key}=<kubeconfig of cluster B>"
            )
        encoded = (secret.get("data") or {}).get(ref.key)
        if not encoded:
            raise RemoteClusterUnavailable(
                f"Secret {namespace}/{ref.name} has no key {ref.key!r}; "
                "set remoteCluster.kubeconfigSecret.key to the key holding the kubeconfig"
            )
        text = base64.b64decode(encoded).decode()
        fingerprint = hashlib.sha256(text.encode()).hexdigest()
        key = (namespace, ref.name, ref.key)
        async with self._building.setdefault(key, asyncio.Lock()):
            cached = self._clients.get(key)
            if cached is not None and cached[0] == fingerprint:
                return cached[1]
            client = await client_from_kubeconfig(text)
            if cached is not None:
                await cached[1].aclose()
            self._clients[key] = (fingerprint, client)
            return client

    async def aclose(self) -> None:
        """Close every client (the operator is exiting)."""
        clients, self._clients = self._clients, {}
        for _, client in clients.values():
            await client.aclose()
