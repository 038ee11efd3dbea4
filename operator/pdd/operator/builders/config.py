"""The rendered config every worker and router pod reads, and the shared secret.

One JSON document (``/etc/pdd/config.json``) per cluster: the same settings, with peer
addresses as seen from that cluster (cluster B reaches cluster A's Services through
the multi-cluster service domain, and vice versa).
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from pdd.common.config_document import (
    SHARED_SECRET_ENV,
    AnomalousTraffic,
    ConfigDocument,
    DeploymentRef,
    EngineByRole,
    HandoffSection,
    ModelSection,
    Peers,
    Ports,
    RelaySection,
    RouterPeer,
    SloSection,
    StoreSection,
    WanSection,
    WorkerPeer,
)
from pdd.operator.builders.meta import Site, content_hash, metadata
from pdd.operator.kv_size import resolve_wan_kv_bytes_per_token
from pdd.operator.naming import (
    CONFIG_FILE,
    REDIS_PORT,
    RELAY_LOAD_METRIC,
    ROUTER_PORT,
    SHARED_SECRET_KEY,
    WORKER_HTTP_PORT,
    WORKER_KV_PORT,
    WORKER_ROLES,
    WORKER_WAN_PORT,
    Component,
    Owner,
    service_host,
)
from pdd.operator.spec import PDDSpec


def model_path(spec: PDDSpec) -> str:
    """Where the checkpoint is inside the container."""
    image = spec.model.source.image
    return image.path if image is not None else spec.model.mount_path


def peer_hosts(spec: PDDSpec, owner: Owner, site: Site) -> dict[str, str]:
    """Each role's Service DNS name as seen from ``site``'s cluster."""
    remote = spec.remote_cluster
    hosts = {str(role): service_host(owner.child(role), owner.namespace) for role in Component}
    if remote is None:
        return hosts
    remote_ns = remote.namespace or owner.namespace
    main = owner.child(Component.MAIN)
    if site.remote:
        cross = {
            str(role): service_host(owner.child(role), owner.namespace, remote.service_domain)
            for role in Component
        }
        return {**cross, str(Component.MAIN): service_host(main, remote_ns)}
    main_host = remote.main_decode_host or service_host(main, remote_ns, remote.service_domain)
    return {**hosts, str(Component.MAIN): main_host}


def redis_url(spec: PDDSpec, hosts: dict[str, str]) -> str | None:
    if spec.router.redis_url is not None:
        return spec.router.redis_url
    if spec.router.managed_redis:
        return f"redis://{hosts[Component.REDIS]}:{REDIS_PORT}/0"
    return None


def engine_settings(spec: PDDSpec) -> EngineByRole:
    """Each worker role's engine settings: its own ``engine`` over ``spec.engine``."""
    return EngineByRole(
        prefill=spec.prefill.engine.over(spec.engine),
        relay=spec.relay.engine.over(spec.engine),
        main=spec.main_decode.engine.over(spec.engine),
    )


def wan_section(spec: PDDSpec) -> WanSection:
    """The document's ``wan`` section: ``spec.wan``'s fields that it shares (every field of
    ``WanKVSettings``, so a setting added there needs no line here)."""
    return WanSection.model_validate(spec.wan.model_dump(include=set(WanSection.model_fields)))


def slo_section(spec: PDDSpec) -> SloSection:
    """The document's ``slo`` section: ``spec.slo``'s ``SloSection`` fields (the planner's
    targets stay with the operator), so an objective added there needs no line here."""
    return SloSection.model_validate(spec.slo.model_dump(include=set(SloSection.model_fields)))


def build_worker_config(spec: PDDSpec, owner: Owner, site: Site) -> ConfigDocument:
    """The config document for the pods of ``site``'s cluster."""
    hosts = peer_hosts(spec, owner, site)
    workers = {
        str(role): WorkerPeer(host=hosts[role], http_port=WORKER_HTTP_PORT, kv_port=WORKER_KV_PORT)
        for role in WORKER_ROLES
    }
    return ConfigDocument(
        deployment=DeploymentRef(name=owner.name, namespace=owner.namespace),
        model=ModelSection(
            served_name=spec.model.served_name,
            path=model_path(spec),
            kv_bytes_per_token=resolve_wan_kv_bytes_per_token(spec.model, spec.wan.kv_codec),
        ),
        ports=Ports(
            http=WORKER_HTTP_PORT, kv=WORKER_KV_PORT, wan=WORKER_WAN_PORT, router=ROUTER_PORT
        ),
        peers=Peers(**workers, router=RouterPeer(host=hosts[Component.ROUTER], port=ROUTER_PORT)),
        wan=wan_section(spec),
        slo=slo_section(spec),
        handoff=HandoffSection(
            policy=spec.handoff.policy, catch_up_threshold=spec.handoff.catch_up_threshold
        ),
        anomalous_traffic=AnomalousTraffic(
            min_input_tokens=spec.anomalous_traffic.min_input_tokens,
            max_output_tokens=spec.anomalous_traffic.max_output_tokens,
        ),
        engine=engine_settings(spec),
        relay=RelaySection(target_load=spec.relay.target_load, load_metric=RELAY_LOAD_METRIC),
        store=StoreSection(redis_url=redis_url(spec, hosts)),
        shared_secret_env=SHARED_SECRET_ENV,
        drain_seconds=spec.drain_seconds,
    )


def config_hash(config: ConfigDocument) -> str:
    """The pod-template annotation value: a new hash rolls the pods that read it."""
    return content_hash(config.to_wire())


def build_config_map(owner: Owner, site: Site, config: ConfigDocument) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, "config", owner.config_name, site),
        "data": {CONFIG_FILE: config.to_json()},
    }


#: Bytes of randomness in the generated shared secret.
SHARED_SECRET_BYTES = 32


def new_shared_token() -> str:
    """A fresh token for the peers' shared secret (the only impure builder helper)."""
    return secrets.token_urlsafe(SHARED_SECRET_BYTES)


def build_shared_secret(owner: Owner, site: Site, token: str) -> dict[str, Any]:
    """The Secret holding the token peers use to authenticate each other.

    The token is generated once (by the caller, the only impure step) and read back on
    every later reconcile, so the Secret never changes after creation.
    """
    encoded = base64.b64encode(token.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(owner, "secret", owner.secret_name, site),
        "type": "Opaque",
        "data": {SHARED_SECRET_KEY: encoded},
    }
