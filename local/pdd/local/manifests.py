"""Rendered Kubernetes objects -> the pods a kubelet would run: pure planning.

Input: each cluster's objects as the operator renders them (``pdd operator render``):
Deployments, Services, ConfigMaps, Secrets, HorizontalPodAutoscalers (others are
ignored: they have no process). Output: ``PodPlan``s with everything resolved that
Kubernetes resolves before a container starts (replicas, the pod's IP, env from
Secrets and the downward API, ConfigMap and Secret files, volumes) and each cluster's name
table (``hosts``), so ``pdd.testing.pods`` can run them without changing a byte of
their command line, environment or config.

Addresses (``Addressing``, for ``pdd.testing.pods``): pod ``i`` of cluster ``c`` gets
``10.P.c.(i+1)``, the address every peer and Service name sees (``status.podIP``), and
``10.(P+1).c.(i+1)`` on the same interface, the address its node (the runner: probes, the
test's client) and the WAN gateway use. A Service name resolves to its pods' IPs (headless
Services do exactly that; ClusterIP ones get no virtual IP here, which no client of ours can
tell apart). ``HostAddressing`` (for ``pdd.local.hostnet``, which needs no privileges):
every pod shares the host's loopback address, with ports of its own.
"""

from __future__ import annotations

import base64
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd.common.vocabulary import COMPONENT_LABEL
from pdd.local.supervisor import PDD_PROGRAM

#: Image repository -> its entrypoint, for containers without a ``command``.
DEFAULT_ENTRYPOINTS: dict[str, tuple[str, ...]] = {"redis": ("redis-server",)}
#: The resources a CPU-only machine cannot give a pod.
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")


class ManifestError(ValueError):
    """Rendered objects that cannot run here; the message names the object and the fix."""


@dataclass(frozen=True)
class Probe:
    """A readiness probe: an HTTP GET of ``path`` (or a TCP connect when None) on ``port``.

    ``scheme``: ``http``, or ``https`` where the port serves TLS (MD's control API with
    WAN TLS on); like kubelet, the runner then checks no certificate."""

    port: int
    path: str | None = None
    scheme: str = "http"

    def url(self, host: str, port: int) -> str:
        """The probe as a URL on ``host:port``: ``tcp://`` for a connect."""
        if self.path is None:
            return f"tcp://{host}:{port}"
        return f"{self.scheme}://{host}:{port}{self.path}"


@dataclass(frozen=True)
class Addressing:
    """Two /16s of 10/8: ``10.P`` for pod IPs (what peers dial), ``10.(P+1)`` for the
    node-side addresses of the same pods (what the runner and the WAN gateway dial)."""

    pod_octet: int = 240

    def __post_init__(self) -> None:
        if not 1 <= self.pod_octet <= 254:
            raise ValueError(f"pod_octet {self.pod_octet} must be in 1..254")

    @property
    def pod_net(self) -> str:
        return f"10.{self.pod_octet}"

    def pod(self, cluster: int, host: int) -> str:
        return f"10.{self.pod_octet}.{cluster}.{host}"

    def node(self, cluster: int, host: int) -> str:
        return f"10.{self.pod_octet + 1}.{cluster}.{host}"


@dataclass(frozen=True)
class HostAddressing:
    """Every pod on one host address (the pods then differ by port, see ``hostnet``)."""

    address: str = "127.0.0.1"

    def pod(self, cluster: int, host: int) -> str:
        return self.address

    def node(self, cluster: int, host: int) -> str:
        return self.address


@dataclass(frozen=True)
class InitContainer:
    """An init container: run to completion, in order, before the pod's container."""

    name: str
    command: tuple[str, ...]
    args: tuple[str, ...]
    env: dict[str, str]
    #: Where it writes why it failed (kubelet's terminationMessagePath); runners point
    #: it at a file of their own.
    termination_path: str = "/dev/termination-log"


@dataclass(frozen=True)
class PodPlan:
    name: str
    cluster: str
    cluster_index: int
    index: int  # within its cluster: the host part of its addresses
    labels: dict[str, str]
    image: str
    command: tuple[str, ...]  # empty: the image's own entrypoint
    args: tuple[str, ...]
    env: dict[str, str]
    ports: dict[str, int]
    probe: Probe | None
    #: mount path -> file name -> text (ConfigMap and Secret volumes)
    files: dict[str, dict[str, str]] = field(default_factory=dict)
    host_mounts: dict[str, str] = field(default_factory=dict)  # mount path -> host path
    addressing: Addressing | HostAddressing = Addressing()
    init_containers: tuple[InitContainer, ...] = ()

    @property
    def component(self) -> str:
        """What the pod is (prefill, relay, main, router, redis): its component label."""
        return self.labels.get(COMPONENT_LABEL, "")

    @property
    def http_scheme(self) -> str:
        """How its HTTP port speaks, as its readiness probe says (https: TLS)."""
        return self.probe.scheme if self.probe is not None else "http"

    @property
    def pod_ip(self) -> str:
        return self.addressing.pod(self.cluster_index, self.index + 1)

    @property
    def node_ip(self) -> str:
        return self.addressing.node(self.cluster_index, self.index + 1)


@dataclass(frozen=True)
class ClusterObjects:
    """One cluster's rendered objects, by kind and name."""

    name: str
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o.get("kind") == kind]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        for obj in self.of_kind(kind):
            if obj["metadata"]["name"] == name:
                return obj
        raise ManifestError(f"{self.name}: no {kind} named {name!r} among the rendered objects")


def plan_pods(
    clusters: list[ClusterObjects],
    claims: Mapping[str, str] | None = None,
    secrets: Mapping[str, Mapping[str, str]] | None = None,
    addressing: Addressing | HostAddressing = Addressing(),
) -> list[PodPlan]:
    """Every pod of every Deployment, in order. ``claims``: PVC name -> host directory;
    ``secrets``: Secrets the user creates (name -> key -> value), beside rendered ones."""
    pods: list[PodPlan] = []
    for c, cluster in enumerate(clusters):
        index = 0
        for deployment in cluster.of_kind("Deployment"):
            for replica in range(replicas(cluster, deployment)):
                name = f"{deployment['metadata']['name']}-{replica}"
                where = (c, index, addressing)
                pods.append(_pod(cluster, where, name, deployment, claims or {}, secrets or {}))
                index += 1
    return pods


def replicas(cluster: ClusterObjects, deployment: dict[str, Any]) -> int:
    """``spec.replicas``; where an HPA owns the count, its ``minReplicas`` (its floor)."""
    count = deployment["spec"].get("replicas")
    if count is not None:
        return int(count)
    name = deployment["metadata"]["name"]
    for hpa in cluster.of_kind("HorizontalPodAutoscaler"):
        if hpa["spec"]["scaleTargetRef"]["name"] == name:
            return int(hpa["spec"].get("minReplicas", 1))
    return 1


def _pod(
    cluster: ClusterObjects,
    where: tuple[int, int, Addressing | HostAddressing],  # cluster, pod index in it, addresses
    name: str,
    deployment: dict[str, Any],
    claims: Mapping[str, str],
    user_secrets: Mapping[str, Mapping[str, str]],
) -> PodPlan:
    c, index, addressing = where
    template = deployment["spec"]["template"]
    pod_spec = template["spec"]
    if len(pod_spec["containers"]) != 1:
        raise ManifestError(f"{name}: one container per pod is all the runner knows")
    container = pod_spec["containers"][0]
    _refuse_gpus(name, container)
    ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports", [])}
    draft = PodPlan(
        name=name,
        cluster=cluster.name,
        cluster_index=c,
        index=index,
        labels=dict(template["metadata"].get("labels", {})),
        image=container["image"],
        command=tuple(container.get("command", ())),
        args=tuple(container.get("args", ())),
        env={},
        ports=ports,
        probe=_probe(name, container.get("readinessProbe"), ports),
        addressing=addressing,
    )
    env = {e["name"]: _env_value(cluster, draft, e, user_secrets) for e in container.get("env", [])}
    files, host_mounts = _mounts(cluster, name, pod_spec, container, (claims, user_secrets))
    inits = []
    for init in pod_spec.get("initContainers", []):
        if not init.get("command"):
            raise ManifestError(f"{name}: init container {init['name']!r} needs a command here")
        init_env = {e["name"]: _env_value(cluster, draft, e, user_secrets)
                    for e in init.get("env", [])}  # fmt: skip
        more_files, more_mounts = _mounts(cluster, name, pod_spec, init, (claims, user_secrets))
        files, host_mounts = {**more_files, **files}, {**more_mounts, **host_mounts}
        path = init.get("terminationMessagePath", "/dev/termination-log")
        inits.append(InitContainer(init["name"], tuple(init["command"]),
                                   tuple(init.get("args", ())), init_env, path))  # fmt: skip
    return PodPlan(**{**vars(draft), "env": env, "files": files, "host_mounts": host_mounts,
                      "init_containers": tuple(inits)})  # fmt: skip


def _refuse_gpus(name: str, container: dict[str, Any]) -> None:
    resources = container.get("resources") or {}
    for part in ("limits", "requests"):
        for gpu in GPU_RESOURCES:
            if gpu in (resources.get(part) or {}):
                raise ManifestError(
                    f"{name} asks for {gpu} and this machine has none: drop the pool's "
                    "GPU resources to run the manifests here"
                )


def _probe(name: str, probe: dict[str, Any] | None, ports: dict[str, int]) -> Probe | None:
    if probe is None:
        return None
    if "httpGet" in probe:
        get = probe["httpGet"]
        scheme = str(get.get("scheme", "HTTP")).lower()
        return Probe(_port(name, get["port"], ports), get.get("path", "/"), scheme)
    if "tcpSocket" in probe:
        return Probe(_port(name, probe["tcpSocket"]["port"], ports))
    raise ManifestError(f"{name}: only httpGet and tcpSocket readiness probes are run here")


def _port(name: str, port: int | str, ports: dict[str, int]) -> int:
    if isinstance(port, int):
        return port
    if port not in ports:
        raise ManifestError(f"{name}: probe port {port!r} is not a named container port")
    return ports[port]


def _env_value(
    cluster: ClusterObjects,
    pod: PodPlan,
    entry: dict[str, Any],
    user_secrets: Mapping[str, Mapping[str, str]],
) -> str:
    if "value" in entry:
        return str(entry["value"])
    source = entry.get("valueFrom") or {}
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        fields = {"metadata.name": pod.name, "status.podIP": pod.pod_ip}
        if path not in fields:
            raise ManifestError(f"{pod.name}: env {entry['name']} reads {path}, not supported")
        return fields[path]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return _secret_value(cluster, pod.name, ref["name"], ref["key"], user_secrets)
    raise ManifestError(f"{pod.name}: env {entry['name']} has no value the runner can resolve")


def _secret_value(
    cluster: ClusterObjects,
    pod: str,
    name: str,
    key: str,
    user_secrets: Mapping[str, Mapping[str, str]],
) -> str:
    if name in user_secrets and key in user_secrets[name]:
        return user_secrets[name][key]
    secret = cluster.named("Secret", name)
    if key in (secret.get("stringData") or {}):
        return str(secret["stringData"][key])
    data = secret.get("data") or {}
    if key not in data:
        raise ManifestError(f"{pod}: Secret {name!r} has no key {key!r}")
    return base64.b64decode(data[key]).decode()


def _secret_files(
    cluster: ClusterObjects, name: str, user_secrets: Mapping[str, Mapping[str, str]]
) -> dict[str, str]:
    """A Secret volume's files: a user's Secret given to the runner, else a rendered one."""
    if name in user_secrets:
        return dict(user_secrets[name])
    secret = cluster.named("Secret", name)
    files = {
        key: base64.b64decode(value).decode() for key, value in (secret.get("data") or {}).items()
    }
    return {**files, **{key: str(v) for key, v in (secret.get("stringData") or {}).items()}}


def _mounts(
    cluster: ClusterObjects,
    pod: str,
    pod_spec: dict[str, Any],
    container: dict[str, Any],
    sources: tuple[Mapping[str, str], Mapping[str, Mapping[str, str]]],  # claims, user Secrets
) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """Files to write per mount path (ConfigMaps, Secrets; none for an emptyDir) and host
    folders (hostPath, PVCs)."""
    claims, user_secrets = sources
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    files: dict[str, dict[str, str]] = {}
    host_mounts: dict[str, str] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        target = mount["mountPath"]
        if "configMap" in volume:
            config_map = cluster.named("ConfigMap", volume["configMap"]["name"])
            files[target] = dict(config_map.get("data") or {})
        elif "secret" in volume:  # e.g. the WAN TLS certificates
            files[target] = _projected(
                _secret_files(cluster, volume["secret"]["secretName"], user_secrets),
                volume["secret"].get("items"),
            )
        elif "emptyDir" in volume:  # a folder of the pod's own, empty at its start
            files[target] = {}
        elif "hostPath" in volume:
            host_mounts[target] = _sub(volume["hostPath"]["path"], mount)
        elif "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in claims:
                raise ManifestError(
                    f"{pod} mounts PersistentVolumeClaim {claim!r}: give the runner a local "
                    "directory for it"
                )
            host_mounts[target] = _sub(claims[claim], mount)
        else:
            raise ManifestError(f"{pod}: volume {mount['name']!r} is of a kind not run here")
    return files, host_mounts


def _projected(files: dict[str, str], items: list[dict[str, str]] | None) -> dict[str, str]:
    """A volume's ``items`` as kubelet projects them: only those keys, under their paths
    (the router's WAN TLS mount holds ``ca.crt`` alone); all keys without ``items``."""
    if items is None:
        return files
    return {item["path"]: files[item["key"]] for item in items}


def _sub(path: str, mount: dict[str, Any]) -> str:
    sub = mount.get("subPath")
    return f"{path.rstrip('/')}/{sub}" if sub else path


def host_table(
    clusters: list[ClusterObjects], pods: list[PodPlan], service_domain: str
) -> dict[str, dict[str, list[str]]]:
    """Per cluster: DNS name -> pod IPs. Own Services as ``name.ns.svc`` (and the
    ``.cluster.local`` form); the other clusters' as ``name.ns.svc.<service_domain>``,
    the multi-cluster services convention."""
    tables: dict[str, dict[str, list[str]]] = {c.name: {} for c in clusters}
    for cluster in clusters:
        for service in cluster.of_kind("Service"):
            meta = service["metadata"]
            selector = service["spec"].get("selector") or {}
            ips = [
                p.pod_ip for p in pods if p.cluster == cluster.name and _selects(selector, p.labels)
            ]
            short = f"{meta['name']}.{meta['namespace']}.svc"
            for viewer in clusters:
                table = tables[viewer.name]
                if viewer.name == cluster.name:
                    table[short] = ips
                    table[f"{short}.cluster.local"] = ips
                else:
                    table[f"{short}.{service_domain}"] = ips
    return tables


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def hosts_file(table: dict[str, list[str]]) -> str:
    """``/etc/hosts`` text: one line per (address, name), so a lookup returns them all."""
    lines = ["127.0.0.1 localhost"]
    for name, ips in sorted(table.items()):
        lines += [f"{ip} {name}" for ip in ips]
    return "\n".join(lines) + "\n"


def find_program(name: str) -> str | None:
    """Where an image's program is on this machine: on the PATH, else beside this
    interpreter (a virtual environment's ``bin``, where ``scripts/setup.sh`` puts a
    redis-server when the system has none), so an unactivated ``.venv/bin/pdd`` finds it."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def init_argv(pod: PodPlan, init: InitContainer, termination_file: str) -> list[str]:
    """An init container's command line (``pdd`` is this interpreter's), its termination
    message path pointed at ``termination_file``."""
    command = list(init.command)
    if command[0] == "pdd":
        command = [*PDD_PROGRAM, *command[1:]]
    elif (program := find_program(command[0])) is None:
        raise ManifestError(f"{pod.name}: init container {init.name}: {command[0]!r} not found")
    else:
        command[0] = program
    args = [termination_file if a == init.termination_path else a for a in init.args]
    return command + args


def container_argv(pod: PodPlan, entrypoints: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The container's command line with the image's programs found on this machine:
    ``pdd`` is this interpreter's, an image without ``command`` runs its entrypoint."""
    command = list(pod.command)
    if not command:
        repo = pod.image.rsplit("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]
        if repo not in entrypoints:
            raise ManifestError(f"{pod.name}: no local entrypoint for image {pod.image!r}")
        command = list(entrypoints[repo])
    if command[0] == "pdd":
        command = [*PDD_PROGRAM, *command[1:]]
    elif (program := find_program(command[0])) is None:
        raise ManifestError(f"{pod.name}: {command[0]!r} (image {pod.image}) is not installed")
    else:
        command[0] = program
    return command + list(pod.args)
