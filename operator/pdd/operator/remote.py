"""The remote cluster B: a client built from the kubeconfig stored in a Secret.

Only static credentials are supported (a token, or a client certificate and key, with
the CA inline): exec plugins and auth providers run programs or refresh tokens, which
an operator pod cannot do for another cluster.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import kopf
import yaml

from pdd.operator.kube import KubeApi, ObjectPath
from pdd.operator.spec import SecretKeyRef


class RemoteClusterUnavailable(Exception):
    """Cluster B cannot be reached yet (missing Secret or key, unusable kubeconfig)."""


def connection_from_kubeconfig(text: str) -> kopf.ConnectionInfo:
    """A ConnectionInfo for the kubeconfig's current context."""
    try:
        config = yaml.safe_load(text) or {}
        context_name = config["current-context"]
        context = _named(config, "contexts", context_name)["context"]
        cluster = _named(config, "clusters", context["cluster"])["cluster"]
        user = _named(config, "users", context["user"]).get("user") or {}
    except (yaml.YAMLError, KeyError, TypeError) as exc:
        raise RemoteClusterUnavailable(
            f"the kubeconfig has no usable current-context/cluster/user ({exc!r}); "
            "export one with `kubectl config view --minify --flatten`"
        ) from None
    if "exec" in user or "auth-provider" in user:
        raise RemoteClusterUnavailable(
            "the kubeconfig's user runs an exec plugin or auth provider, which the operator "
            "cannot run; use a ServiceAccount token or a client certificate instead"
        )
    return kopf.ConnectionInfo(
        server=cluster["server"],
        ca_data=cluster.get("certificate-authority-data"),
        insecure=cluster.get("insecure-skip-tls-verify"),
        token=user.get("token"),
        certificate_data=user.get("client-certificate-data"),
        private_key_data=user.get("client-key-data"),
        username=user.get("username"),
        password=user.get("password"),
        default_namespace=context.get("namespace"),
    )


def _named(config: dict[str, Any], section: str, name: str) -> dict[str, Any]:
    for item in config.get(section) or []:
        if item.get("name") == name:
            return item
    raise KeyError(f"{section}[name={name!r}]")


class RemoteClients:
    """Clients for cluster B, one per kubeconfig Secret, rebuilt when its content changes."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, str, str], tuple[str, KubeApi]] = {}

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
        cached = self._clients.get(key)
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
        client = KubeApi(connection_from_kubeconfig(text))
        if cached is not None:
            await cached[1].aclose()
        self._clients[key] = (fingerprint, client)
        return client
