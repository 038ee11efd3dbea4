"""Names, labels, ports and peer addresses of a PDDDeployment's children.

Every child name is derived from the PDDDeployment's name, never stored: the operator
finds, updates and deletes its children (in both clusters) by recomputing the names,
which is also what lets cluster B objects be cleaned without owner references.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pdd.common.vocabulary import COMPONENT_LABEL as COMPONENT_LABEL  # the pod label
from pdd.common.vocabulary import PDD_ROLES, Role
from pdd.common.vocabulary import RELAY_LOAD_METRIC as RELAY_LOAD_METRIC  # the HPA metric

GROUP = "pdd.dev"
VERSION = "v1alpha1"
PLURAL = "pdddeployments"
KIND = "PDDDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

#: The operator's field manager (server-side apply) and managed-by label value.
MANAGER = "pdd-operator"
#: The finalizer that holds a PDDDeployment until its cluster B objects are gone.
FINALIZER = "pdd.dev/cleanup"
#: sha256 of a child's desired state; a child is written only when this differs.
SPEC_HASH_ANNOTATION = "pdd.dev/spec-hash"
#: sha256 of the rendered config, on pod templates, so a config change rolls the pods.
CONFIG_HASH_ANNOTATION = "pdd.dev/config-hash"
#: Labels that tie cluster B objects to their PDDDeployment (no cross-cluster owners).
OWNER_UID_LABEL = "pdd.dev/owner-uid"
OWNER_NAMESPACE_LABEL = "pdd.dev/owner-namespace"
DEPLOYMENT_LABEL = "pdd.dev/deployment"

#: Worker HTTP API (+ /metrics, /health), the data port for peers in the same datacenter,
#: the data port for peers across the WAN (its own Service, so that cluster B's traffic can
#: be admitted to it alone), the router's port.
WORKER_HTTP_PORT = 8000
WORKER_KV_PORT = 9000
WORKER_WAN_PORT = 9100
ROUTER_PORT = 8080
REDIS_PORT = 6379

#: Where the rendered config is mounted in every pod, and the file inside it.
CONFIG_DIR = "/etc/pdd"
CONFIG_FILE = "config.json"
#: Where the WAN TLS Secret is mounted in worker pods (beside, not inside, CONFIG_DIR: the
#: config volume owns that folder).
WAN_TLS_DIR = "/etc/pdd-wan-tls"
#: The key of the shared secret inside the generated Secret.
SHARED_SECRET_KEY = "token"


class Component(StrEnum):
    """A kind of pod the operator renders: the three worker roles, the router and Redis.

    The worker values are the shared vocabulary's roles (``pdd worker --role``)."""

    PREFILL = Role.PREFILL.value
    RELAY = Role.RELAY.value
    MAIN = Role.MAIN.value
    ROUTER = "router"
    REDIS = "redis"


WORKER_ROLES = tuple(Component(role) for role in PDD_ROLES)
#: Roles that peers reach across the WAN: MD (P's KV) and RLD (MD's handoff calls).
WAN_FACING_ROLES = (Component.RELAY, Component.MAIN)


@dataclass(frozen=True)
class Owner:
    """The PDDDeployment a child belongs to: enough for names, labels and owner refs."""

    name: str
    namespace: str
    uid: str

    def child(self, role: Component | str) -> str:
        return f"{self.name}-{role}"

    def wan_service_name(self, role: Component) -> str:
        """The Service of a role's WAN data port (what cluster B's peers reach)."""
        return f"{self.child(role)}-wan"

    @property
    def config_name(self) -> str:
        return f"{self.name}-config"

    @property
    def secret_name(self) -> str:
        return f"{self.name}-shared-secret"

    @property
    def wan_tls_secret_name(self) -> str:
        """The generated WAN TLS Secret (when the spec names no Secret of its own)."""
        return f"{self.name}-wan-tls"

    def selector_labels(self, role: Component | str) -> dict[str, str]:
        """The labels a role's Deployment selects on (never change: selectors are immutable)."""
        return {
            "app.kubernetes.io/name": "pdd",
            "app.kubernetes.io/instance": self.name,
            COMPONENT_LABEL: str(role),
        }

    def labels(self, role: Component | str) -> dict[str, str]:
        return {
            **self.selector_labels(role),
            "app.kubernetes.io/managed-by": MANAGER,
            DEPLOYMENT_LABEL: self.name,
            OWNER_NAMESPACE_LABEL: self.namespace,
            OWNER_UID_LABEL: self.uid,
        }

    def owner_reference(self) -> dict[str, object]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def service_host(service: str, namespace: str, domain: str | None = None) -> str:
    """A Service's DNS name; ``domain`` for cross-cluster (e.g. clusterset.local) names."""
    if domain is None:
        return f"{service}.{namespace}.svc"
    return f"{service}.{namespace}.svc.{domain}"
