"""What ``pdd up`` runs in each mode: a PDDDeployment, rendered by the operator, less what
the mode leaves out. Pure builders.

| mode   | cluster A            | cluster B           | WAN lines (one per direction) | router  |
| ------ | -------------------- | ------------------- | ----------------------------- | ------- |
| pdd    | P, RLD               | MD                  | A->B to MD, B->A to RLD and P | policy  |
| naive  | P                    | MD                  | A->B to MD                    | naive   |
| samedc | P, MD                | -                   | none (fast path only)         | naive   |
| mono   | colocated workers    | -                   | none                          | mono    |

``stack_deployment`` turns ``pdd up``'s flags into the PDDDeployment a cluster user would
``kubectl apply`` (MD in a remote cluster where the mode crosses the WAN); the operator's
own ``pdd operator render`` makes the manifests, so a worker's command line, environment
and config document are made one way, for a cluster and for this machine alike.
``mode_objects`` then drops what a baseline does not run: "naive" is cross-datacenter PD
without PDD (P ships the full KV over the WAN, no decode-side cache match), "samedc" the
same pipeline with MD next to P, "mono" the prefill pods as colocated workers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pdd.common.vocabulary import Role
from pdd.local.cluster import LinkSpec
from pdd.local.manifests import COMPONENT_LABEL, ClusterObjects

Mode = Literal["pdd", "naive", "samedc", "mono"]
MODES: tuple[Mode, ...] = ("mono", "samedc", "naive", "pdd")

#: The router flags that make it plan the naive pipeline (full KV, no DRC match).
NAIVE_ROUTER_FLAGS: tuple[str, ...] = ("--force-pipeline", "naive")


#: The emulated WAN line's defaults, sized for the tiny model: its KV is 2 KiB per token,
#: so a few thousand prompt tokens per second are tens of Mbit/s of KV, and a 50 Mbit/s
#: line makes full-KV shipping the bottleneck, as a 10-100 Gbit/s line is for a large model.
DEFAULT_LINK = LinkSpec(gbps=0.05, rtt_ms=30.0, jitter_ms=5.0)


class TopologyError(ValueError):
    """An inconsistent ``pdd up`` configuration; the message says what to change."""


@dataclass(frozen=True)
class Counts:
    prefill: int = 1
    relay: int = 1
    main: int = 1
    mono: int = 1

    def __post_init__(self) -> None:
        for name in ("prefill", "relay", "main", "mono"):
            if getattr(self, name) < 1:
                raise TopologyError(f"--{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class StackConfig:
    mode: Mode = "pdd"
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 8080
    counts: Counts = Counts()
    link: LinkSpec = DEFAULT_LINK
    redis_url: str | None = None
    log_dir: Path = Path("pdd-logs")
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    ready_timeout_s: float = 180.0
    served_model_name: str | None = None
    #: The TTFT the router's P-MD path must meet; None keeps the router's default.
    ttft_budget_s: float | None = None

    @property
    def served_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.port}"


#: The PDDDeployment ``pdd up`` renders: pods are named after it (``pdd-prefill-0``).
DEPLOYMENT_NAME = "pdd"
NAMESPACE = "local"
#: Images are not pulled here: ``pdd`` in the container's command is this install's.
LOCAL_IMAGE = "pdd:local"
#: Modes whose MD runs in the other datacenter (behind the WAN lines).
CROSS_DATACENTER: tuple[Mode, ...] = ("pdd", "naive")


def stack_deployment(config: StackConfig) -> dict[str, Any]:
    """The PDDDeployment that ``config`` describes (``pdd up`` writes it to its log folder:
    the same file, with images and pools of a cluster, deploys it there)."""
    counts = config.counts
    model = config.model if config.model == "tiny" else str(Path(config.model).resolve())
    spec: dict[str, Any] = {
        "model": {"servedName": config.served_name, "source": {"image": {"path": model}}},
        "images": {"worker": LOCAL_IMAGE, "router": LOCAL_IMAGE},
        "prefill": {"replicas": counts.mono if config.mode == "mono" else counts.prefill},
        "relay": {"minReplicas": counts.relay, "maxReplicas": counts.relay},
        "mainDecode": {"replicas": counts.main},
        "wan": {"declaredGbps": config.link.gbps, "rttMs": config.link.rtt_ms},
    }
    if config.mode in CROSS_DATACENTER:
        spec["remoteCluster"] = {"kubeconfigSecret": {"name": "cluster-b-kubeconfig"}}
    else:  # MD on a node pool of the same cluster: this host
        spec["poolB"] = {}
    if config.ttft_budget_s is not None:
        spec["slo"] = {"ttftP99Ms": config.ttft_budget_s * 1000.0}
    if config.redis_url:
        spec["router"] = {"redisUrl": config.redis_url}
    return {
        "apiVersion": "pdd.dev/v1alpha1",
        "kind": "PDDDeployment",
        "metadata": {"name": DEPLOYMENT_NAME, "namespace": NAMESPACE},
        "spec": spec,
    }


@dataclass(frozen=True)
class WorkerSlot:
    """A worker a mode runs, named as its rendered pod is."""

    name: str
    role: Role


def mode_workers(mode: Mode, counts: Counts) -> list[WorkerSlot]:
    """The workers of a mode in start order, known before anything is rendered (so flags
    are refused early); a test holds it equal to the rendered pods."""
    if mode == "mono":
        by_role = {Role.MONO: counts.mono}
    else:
        relay = counts.relay if mode == "pdd" else 0
        by_role = {Role.PREFILL: counts.prefill, Role.RELAY: relay, Role.MAIN: counts.main}
    return [
        WorkerSlot(f"{DEPLOYMENT_NAME}-{role}-{i}", role)
        for role, count in by_role.items()
        for i in range(count)
    ]


def mode_objects(mode: Mode, clusters: list[ClusterObjects]) -> list[ClusterObjects]:
    """The rendered objects a mode runs: the baselines leave out the relay's Deployment;
    mono turns the prefill Deployment into colocated workers and drops the rest."""
    if mode == "pdd":
        return clusters
    dropped = {Role.RELAY, Role.MAIN} if mode == "mono" else {Role.RELAY}
    kept = []
    for cluster in clusters:
        objects = []
        for obj in cluster.objects:
            component = _component(obj)
            if obj.get("kind") == "Deployment" and component in dropped:
                continue
            if obj.get("kind") == "Deployment" and mode == "mono" and component == Role.PREFILL:
                obj = as_mono(obj)
            objects.append(obj)
        kept.append(ClusterObjects(cluster.name, objects))
    return kept


def _component(obj: dict[str, Any]) -> str | None:
    return obj["metadata"].get("labels", {}).get(COMPONENT_LABEL)


def as_mono(deployment: dict[str, Any]) -> dict[str, Any]:
    """The prefill Deployment as colocated workers: same pod, ``--role mono``, renamed
    (so the pods' names, and with them their instance ids, say what they are)."""
    mono = copy.deepcopy(deployment)
    meta, template = mono["metadata"], mono["spec"]["template"]
    meta["name"] = meta["name"].removesuffix(str(Role.PREFILL)) + str(Role.MONO)
    for labels in (meta.setdefault("labels", {}), template["metadata"].setdefault("labels", {})):
        labels[COMPONENT_LABEL] = str(Role.MONO)
    container = template["spec"]["containers"][0]
    args = container["args"]
    args[args.index("--role") + 1] = str(Role.MONO)
    return mono


def extra_args(config: StackConfig) -> dict[str, tuple[str, ...]]:
    """Flags appended per component: the user's ``--worker-arg``/``--router-arg``, and
    the baselines' router flags."""
    router = NAIVE_ROUTER_FLAGS if config.mode in ("naive", "samedc") else ()
    workers = {str(role): config.worker_args for role in Role}
    return {**workers, "router": router + config.router_args}
