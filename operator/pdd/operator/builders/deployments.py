"""Deployments: P and RLD on pool A, MD on pool B (or cluster B), the router, Redis."""

from __future__ import annotations

from typing import Any

from pdd.common.config_document import API_KEYS_ENV, SHARED_SECRET_ENV
from pdd.common.vocabulary import Role
from pdd.common.wan_tls import CA_FILE, HTTPS_ROLES
from pdd.operator.builders.config import model_path
from pdd.operator.builders.engine import engine_args, worker_image
from pdd.operator.builders.meta import Site, metadata
from pdd.operator.builders.model_pull import (
    MODEL_VOLUME,
    model_pull_container,
    model_pull_volume,
    pulls_model,
)
from pdd.operator.builders.tracing import tracing_env
from pdd.operator.builders.wan_tls import wan_tls_secret_name
from pdd.operator.naming import (
    CONFIG_DIR,
    CONFIG_FILE,
    CONFIG_HASH_ANNOTATION,
    REDIS_PORT,
    ROUTER_PORT,
    SHARED_SECRET_KEY,
    WAN_TLS_DIR,
    WORKER_HTTP_PORT,
    WORKER_KV_PORT,
    WORKER_WAN_PORT,
    Component,
    Owner,
)
from pdd.operator.spec import PDDSpec, Pool

#: Beyond spec.drainSeconds, the seconds a pod gets to close up before it is killed.
EXIT_MARGIN_SECONDS = 10
#: GPU pools rarely have a spare node for a surge pod: replace pods one at a time.
WORKER_STRATEGY = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
#: Seconds between two startup probes of a worker; spec.startupSeconds sets how many.
WORKER_STARTUP_PERIOD_S = 10
#: The router starts in seconds (no model): a minute before kubelet gives up on it.
ROUTER_STARTUP = {"periodSeconds": 2, "failureThreshold": 30}
#: Liveness: a minute of failed answers (a dead engine thread, a wedged process) before a
#: restart; long enough that a busy pod is not killed for one slow answer.
LIVENESS = {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6}
#: Readiness: out of its Service within 15 s of turning unready (a drain says so at once).
READINESS = {"periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3}
#: The managed Redis: memory for its soft state (prefix index, load counters).
REDIS_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}


def worker_pool(spec: PDDSpec, role: Component) -> Pool:
    return spec.main_pool if role is Component.MAIN else spec.pool_a


def worker_replicas(spec: PDDSpec, role: Component) -> int | None:
    """Replicas the operator sets; None where an HPA owns the count (the relay's always,
    every role's with the planner on)."""
    if spec.planner.enabled:
        return None
    if role is Component.PREFILL:
        return spec.prefill.replicas
    if role is Component.MAIN:
        return spec.main_decode.replicas
    return None


#: A worker role's field in the spec (where its resources are).
ROLE_FIELDS = {Component.PREFILL: "prefill", Component.RELAY: "relay", Component.MAIN: "mainDecode"}


def _worker_startup(spec: PDDSpec) -> dict[str, int]:
    """The startup probe's budget: spec.startupSeconds to load the model and start serving
    (liveness and readiness wait until it passes, so a slow load is not a restart loop)."""
    periods = -(-spec.startup_seconds // WORKER_STARTUP_PERIOD_S)  # ceiling
    return {"periodSeconds": WORKER_STARTUP_PERIOD_S, "failureThreshold": periods}


def build_worker_deployment(
    spec: PDDSpec, owner: Owner, role: Component, site: Site, config_hash: str
) -> dict[str, Any]:
    """A worker role's Deployment. The relay's has no ``replicas``: the HPA sets it."""
    pool = worker_pool(spec, role)
    role_spec = spec.worker_roles[ROLE_FIELDS[role]]
    config = f"{CONFIG_DIR}/{CONFIG_FILE}"
    tls_secret = wan_tls_secret_name(spec, owner)
    # The router reaches this role's HTTP port across the WAN: with TLS on it serves https.
    https = tls_secret is not None and Role(role) in HTTPS_ROLES
    container: dict[str, Any] = {
        "name": str(role),
        "image": worker_image(spec, role_spec),
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["pdd"],
        "args": ["worker", "--role", str(role), "--config", config, *engine_args(role_spec)],
        "ports": [
            {"name": "http", "containerPort": WORKER_HTTP_PORT},
            {"name": "kv", "containerPort": WORKER_KV_PORT},
            {"name": "wan", "containerPort": WORKER_WAN_PORT},
        ],
        "env": _common_env(owner, role) + tracing_env(spec, owner, role, site),
        "resources": spec.container_resources[ROLE_FIELDS[role]].manifest(),
        **_probes(https, _worker_startup(spec)),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
    }
    volumes = [_config_volume(owner)]
    if tls_secret is not None:
        # Every worker role crosses the WAN: P dials MD, MD dials RLD, RLD and MD serve.
        volumes.append({"name": "wan-tls", "secret": {"secretName": tls_secret}})
        container["volumeMounts"].append(
            {"name": "wan-tls", "mountPath": WAN_TLS_DIR, "readOnly": True}
        )
        container["args"] += ["--wan-tls-dir", WAN_TLS_DIR]
    model_volume = _model_volume(spec)
    if model_volume is not None:
        volumes.append(model_volume)
        container["volumeMounts"].append(_model_mount(spec))
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": pool.node_selector_with_gpu(),
        "tolerations": [toleration.manifest() for toleration in pool.tolerations],
        # SIGTERM starts the worker's drain (up to drainSeconds), then it exits by itself.
        "terminationGracePeriodSeconds": spec.drain_seconds + EXIT_MARGIN_SECONDS,
    }
    if pulls_model(spec):
        pod_spec["initContainers"] = [model_pull_container(spec, model_path(spec), router=False)]
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": owner.selector_labels(role)},
        "strategy": WORKER_STRATEGY,
        "template": _template(spec, owner, role, pod_spec, config_hash, WORKER_HTTP_PORT, https),
    }
    replicas = worker_replicas(spec, role)
    if replicas is not None:
        deployment_spec["replicas"] = replicas
    return _deployment(owner, role, site, deployment_spec)


def build_router_deployment(spec: PDDSpec, owner: Owner, config_hash: str) -> dict[str, Any]:
    """The router: CPU only, so it carries no pool's GPU selector."""
    site = Site(owner.namespace)
    env = _common_env(owner, Component.ROUTER) + _api_keys_env(spec)
    container: dict[str, Any] = {
        "name": str(Component.ROUTER),
        "image": spec.images.router,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["pdd"],
        "args": ["router", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        "env": env + tracing_env(spec, owner, Component.ROUTER, site),
        "resources": spec.container_resources["router"].manifest(),
        **_probes(False, ROUTER_STARTUP),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
    }
    volumes = [_config_volume(owner)]
    tls_secret = wan_tls_secret_name(spec, owner)
    if tls_secret is not None:
        # Only ca.crt: the router verifies MD's https certificate and presents none (the
        # bearer secret authenticates it), so the private key stays with the workers.
        only_ca = {"secretName": tls_secret, "items": [{"key": CA_FILE, "path": CA_FILE}]}
        volumes.append({"name": "wan-tls", "secret": only_ca})
        container["volumeMounts"].append(
            {"name": "wan-tls", "mountPath": WAN_TLS_DIR, "readOnly": True}
        )
        container["args"] += ["--wan-tls-dir", WAN_TLS_DIR]
    pod_spec: dict[str, Any] = {"containers": [container], "volumes": volumes}
    if pulls_model(spec):  # the router tokenizes: it needs the tokenizer files only
        volumes.append(model_pull_volume(spec, router=True))
        container["volumeMounts"].append(
            {"name": MODEL_VOLUME, "mountPath": model_path(spec), "readOnly": True}
        )
        pod_spec["initContainers"] = [model_pull_container(spec, model_path(spec), router=True)]
    return _deployment(
        owner,
        Component.ROUTER,
        site,
        {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": owner.selector_labels(Component.ROUTER)},
            "template": _template(
                spec, owner, Component.ROUTER, pod_spec, config_hash, ROUTER_PORT
            ),
        },
    )


def build_redis_deployment(spec: PDDSpec, owner: Owner) -> dict[str, Any]:
    """A single in-memory Redis for the routers' shared state (managedRedis: true).

    Its contents are soft state (prefix index, load counters) that the routers rebuild,
    so no persistence and one replica; point router.redisUrl at a managed Redis for HA.
    """
    container = {
        "name": str(Component.REDIS),
        "image": spec.images.redis,
        "imagePullPolicy": spec.images.pull_policy,
        "args": ["--save", "", "--appendonly", "no"],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "resources": REDIS_RESOURCES,
        "livenessProbe": {"tcpSocket": {"port": "redis"}, **LIVENESS},
        "readinessProbe": {"tcpSocket": {"port": "redis"}, **READINESS},
    }
    labels = owner.labels(Component.REDIS)
    return _deployment(
        owner,
        Component.REDIS,
        Site(owner.namespace),
        {
            "replicas": 1,
            "selector": {"matchLabels": owner.selector_labels(Component.REDIS)},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    )


def _deployment(owner: Owner, role: Component, site: Site, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, role, owner.child(role), site),
        "spec": spec,
    }


def _template(
    spec: PDDSpec,
    owner: Owner,
    role: Component,
    pod_spec: dict[str, Any],
    config_hash: str,
    metrics_port: int,
    https: bool = False,
) -> dict[str, Any]:
    if spec.images.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in spec.images.pull_secrets]
    annotations = {
        CONFIG_HASH_ANNOTATION: config_hash,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(metrics_port),
        "prometheus.io/path": "/metrics",
    }
    if https:
        # The annotation-driven scrape job maps this to __scheme__; its tls_config needs
        # the deployment's ca.crt (or the job skips verification): docs/kubernetes.md.
        annotations["prometheus.io/scheme"] = "https"
    return {
        "metadata": {"labels": owner.labels(role), "annotations": annotations},
        "spec": pod_spec,
    }


def _common_env(owner: Owner, role: Component) -> list[dict[str, Any]]:
    return [
        {"name": "PDD_ROLE", "value": str(role)},
        {"name": "PDD_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"},
        {"name": "PDD_INSTANCE_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PDD_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {
            "name": SHARED_SECRET_ENV,
            "valueFrom": {"secretKeyRef": {"name": owner.secret_name, "key": SHARED_SECRET_KEY}},
        },
    ]


def _api_keys_env(spec: PDDSpec) -> list[dict[str, Any]]:
    """The client API keys from the user's Secret; without one the router is open."""
    ref = spec.router.api_keys_secret
    if ref is None:
        return []
    return [
        {"name": API_KEYS_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
    ]


def _probes(https: bool, startup: dict[str, int]) -> dict[str, Any]:
    """Startup, liveness and readiness probes, each on its own endpoint of the http port.

    /startup answers once the process serves (the model loaded); /live while it can do its
    work (a worker's engine thread runs); /ready while it should get traffic (false the
    moment a drain starts, so the pod leaves its Service at once, but stays live)."""
    return {
        "startupProbe": _http_probe("/startup", https, startup),
        "livenessProbe": _http_probe("/live", https, LIVENESS),
        "readinessProbe": _http_probe("/ready", https, READINESS),
    }


def _http_probe(path: str, https: bool, budget: dict[str, int]) -> dict[str, Any]:
    """An HTTP GET probe; on an https port kubelet speaks TLS without checking the
    certificate and without presenting one (why the control API asks for none)."""
    get: dict[str, Any] = {"path": path, "port": "http"}
    if https:
        get["scheme"] = "HTTPS"
    return {"httpGet": get, **budget}


def _config_volume(owner: Owner) -> dict[str, Any]:
    return {"name": "config", "configMap": {"name": owner.config_name}}


def _model_volume(spec: PDDSpec) -> dict[str, Any] | None:
    source = spec.model.source
    if source.pvc is not None:
        claim = {"claimName": source.pvc.claim_name, "readOnly": True}
        return {"name": "model", "persistentVolumeClaim": claim}
    if source.host_path is not None:
        return {"name": "model", "hostPath": {"path": source.host_path.path, "type": "Directory"}}
    if source.hugging_face is not None:
        return model_pull_volume(spec, router=False)
    return None


def _model_mount(spec: PDDSpec) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": "model", "mountPath": model_path(spec), "readOnly": True}
    pvc = spec.model.source.pvc
    if pvc is not None and pvc.sub_path:
        mount["subPath"] = pvc.sub_path
    return mount
