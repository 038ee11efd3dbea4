"""Run rendered pods as plain processes on the host's loopback: ``pdd up`` and ``pdd bench``.

The unprivileged sibling of ``pods`` (which gives each pod a network namespace and so
needs root). Here every pod shares 127.0.0.1, so what a pod network gives a pod is
given by flags instead, the only thing added to a rendered container's command line
(explicit flags win over the config document, so nothing else changes):

- each named container port gets a free host port; a worker is told to listen on its
  ports and to advertise them (``--http``/``--data``/``--wan``, ``--advertise-*``), a
  router its ``--host``/``--port``, the workers' URLs (the instances its Service names
  would resolve to) by pod name, which is also each worker's instance id, and the
  managed Redis's address; that Redis its ``--port``;
- mounted ConfigMap and Secret files (the WAN TLS certificates) are written under the log
  folder (an emptyDir is an empty folder there), and arguments that point into a mount
  point there instead; so is the model path of the config document (``--model``);
- init containers (a huggingFace source's model pull) run to completion first, in
  order, their output in the pod's log; one that fails stops the start with its
  termination message;
- with two clusters, one ``pdd wan-link`` per direction a connection starts in, each a
  line carrying a route to every worker WAN port of the other cluster; a worker
  advertises its route on the line the other cluster dials as its WAN address, so every
  data-plane byte between the datacenters crosses an emulated line (the router's HTTP
  calls to the workers do not: they are the control path, as in ``LocalCluster``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdd.common.vocabulary import Role
from pdd.local.cluster import (
    HOST,
    LinkSpec,
    free_port,
    http_ok,
    refused_settings,
    wan_link_argv,
)
from pdd.local.manifests import (
    DEFAULT_ENTRYPOINTS,
    ManifestError,
    PodPlan,
    container_argv,
    init_argv,
)
from pdd.local.supervisor import PDD_PROGRAM, Supervisor, wait_ready

#: Components whose pods run ``pdd worker``.
WORKER_COMPONENTS = frozenset({Role.PREFILL, Role.RELAY, Role.MAIN, Role.MONO})
ROUTER_COMPONENT = "router"
#: The managed Redis (``router.managedRedis``): the routers are pointed at it.
REDIS_COMPONENT = "redis"
#: The lines' names, by the cluster whose pods dial through them (cluster 0 is A).
LINE_NAMES = ("wan-link-a-to-b", "wan-link-b-to-a")


class HostPodsStartError(RuntimeError):
    """A pod or line exited or never became ready; the message carries its log's tail."""


@dataclass(frozen=True)
class HostPod:
    """A pod placed on the host: its plan and the host port of each named container port."""

    plan: PodPlan
    ports: dict[str, int]

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def role(self) -> str:
        return self.plan.component

    def address(self, port: str) -> str:
        return f"{HOST}:{self.ports[port]}"

    @property
    def http_url(self) -> str:
        return f"{self.plan.http_scheme}://{self.address('http')}"

    def probe_url(self) -> str | None:
        """The readiness probe as a URL: ``http(s)://`` for an HTTP GET, ``tcp://`` for a
        connect; None without a probe."""
        probe = self.plan.probe
        if probe is None:
            return None
        by_number = {number: name for name, number in self.plan.ports.items()}
        return probe.url(HOST, self.ports[by_number[probe.port]])


@dataclass(frozen=True)
class Line:
    """One direction of the emulated WAN: pods of ``dialer`` reach the other cluster's
    workers' WAN ports through it. ``routes``: worker name -> (listen, to)."""

    dialer: int
    routes: dict[str, tuple[str, str]]
    admin: str

    @property
    def name(self) -> str:
        return LINE_NAMES[self.dialer]

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin}"


#: Where host ports come from (tests pass a counter: a unit test opens no socket).
PortSource = Callable[[], int]


def place(
    plans: Sequence[PodPlan], router_port: int | None = None, port: PortSource = free_port
) -> list[HostPod]:
    """A free host port for every named container port; ``router_port`` for the router's."""
    placed = []
    for plan in plans:
        ports = {name: port() for name in plan.ports}
        if plan.component == ROUTER_COMPONENT and router_port is not None:
            ports["http"], router_port = router_port, None  # the first router's
        placed.append(HostPod(plan, ports))
    return placed


def plan_lines(pods: Sequence[HostPod], port: PortSource = free_port) -> list[Line]:
    """The two directions' lines where pods span two clusters; none within one."""
    if len({p.plan.cluster_index for p in pods}) < 2:
        return []
    lines = []
    for dialer in (0, 1):
        routes = {
            p.name: (f"{HOST}:{port()}", p.address("wan"))
            for p in pods
            if p.plan.cluster_index != dialer and p.role in WORKER_COMPONENTS and "wan" in p.ports
        }
        if routes:
            lines.append(Line(dialer, routes, f"{HOST}:{port()}"))
    return lines


def worker_network_args(pod: HostPod, lines: Sequence[Line]) -> list[str]:
    """Where a worker listens and what it advertises: its own ports, and as WAN address
    its route on the line the other cluster dials (its own WAN port without lines)."""
    wan = pod.address("wan") if "wan" in pod.ports else pod.address("kv")
    for line in lines:
        if line.dialer != pod.plan.cluster_index and pod.name in line.routes:
            wan = line.routes[pod.name][0]
    args = ["--http", pod.address("http"), "--data", pod.address("kv")]
    if "wan" in pod.ports:
        args += ["--wan", pod.address("wan")]
    args += ["--advertise-http", pod.address("http"), "--advertise-fast", pod.address("kv")]
    return [*args, "--advertise-wan", wan]


def router_network_args(pod: HostPod, pods: Sequence[HostPod], host: str = HOST) -> list[str]:
    """The router's listen address, its workers named by pod (their instance ids), and
    the managed Redis where one runs."""
    args = ["--host", host, "--port", str(pod.ports["http"])]
    for worker in (p for p in pods if p.role in WORKER_COMPONENTS):
        args += [f"--{worker.role}", f"{worker.name}={worker.http_url}"]
    for redis in (p for p in pods if p.role == REDIS_COMPONENT):
        args += ["--redis", f"redis://{redis.address('redis')}/0"]
    return args


def host_argv(pod: HostPod, mounts: Mapping[str, str]) -> list[str]:
    """The container's command line with arguments inside a mount pointed at the host
    folder that stands for it (``mounts``: mount path -> host path)."""
    argv = container_argv(pod.plan, DEFAULT_ENTRYPOINTS)
    return [_on_host(arg, mounts) for arg in argv]


def _on_host(arg: str, mounts: Mapping[str, str]) -> str:
    for target, source in mounts.items():
        if arg == target or arg.startswith(target.rstrip("/") + "/"):
            return source + arg[len(target.rstrip("/")) :]
    return arg


@dataclass
class HostPods:
    """Placed pods and lines; ``stop()`` ends every process. Every pod is placed (its ports
    known to the router and the lines) but a pod in ``standby`` is not started until
    ``start_pod``: the slots ``pdd up --autoscale`` scales workers into."""

    pods: list[HostPod]
    lines: list[Line]
    supervisor: Supervisor
    log_dir: Path
    #: Environment of every process; flags appended per component (``start_host_pods``).
    env: Mapping[str, str] = field(default_factory=dict)
    extra_args: Mapping[str, Sequence[str]] = field(default_factory=dict)
    router_host: str = HOST

    def of_role(self, role: str) -> list[HostPod]:
        return [p for p in self.pods if p.role == role]

    def start_pod(self, pod: HostPod, append: bool = False) -> None:
        """Start ``pod``'s process (its init containers first) without waiting for it;
        ``append``: after what its log holds (a slot started again)."""
        mounts = _write_volumes(pod, self.log_dir)
        _run_init_containers(pod, mounts, dict(self.env), self.log_dir)
        argv = host_argv(pod, mounts) + _model_arg(pod, mounts)
        argv += _network_args(pod, self.pods, self.lines, self.router_host)
        argv += list(self.extra_args.get(pod.role, ()))
        log = self.log_dir / f"{pod.name}.log"
        append = append or bool(pod.plan.init_containers)  # their output begins the log
        self.supervisor.spawn(pod.name, argv, log, {**self.env, **pod.plan.env}, append)

    def stop(self) -> None:
        self.supervisor.stop()


def start_host_pods(
    plans: Sequence[PodPlan],
    log_dir: Path,
    *,
    link: LinkSpec,
    env: Mapping[str, str] | None = None,
    extra_args: Mapping[str, Sequence[str]] | None = None,
    router_port: int | None = None,
    router_host: str = HOST,
    ready_timeout_s: float = 180.0,
    standby: Collection[str] = (),
) -> HostPods:
    """Place, start and wait for every pod (and line) but those ``standby`` names, which
    are only placed. ``extra_args``: by component, flags appended after everything else
    (a user's ``--worker-arg``), so they win. The router listens on
    ``router_host:router_port`` (its probe is still made on loopback)."""
    pods = place(plans, router_port)
    lines = plan_lines(pods)
    log_dir.mkdir(parents=True, exist_ok=True)
    running = HostPods(
        pods, lines, Supervisor(), log_dir, dict(env or {}), dict(extra_args or {}), router_host
    )
    try:
        for line in lines:
            argv = wan_link_argv(link, list(line.routes.values()), line.admin)
            running.supervisor.spawn(
                line.name, [*PDD_PROGRAM, *argv], log_dir / f"{line.name}.log", running.env, False
            )
        for pod in pods:
            if pod.name not in standby:
                running.start_pod(pod)
        _wait_ready(running, time.monotonic() + ready_timeout_s)
    except BaseException:
        running.stop()
        raise
    return running


def _network_args(
    pod: HostPod, pods: Sequence[HostPod], lines: Sequence[Line], router_host: str
) -> list[str]:
    if pod.role in WORKER_COMPONENTS:
        return worker_network_args(pod, lines)
    if pod.role == ROUTER_COMPONENT:
        return router_network_args(pod, pods, router_host)
    if pod.role == REDIS_COMPONENT:
        return ["--port", str(pod.ports["redis"]), "--bind", HOST]
    raise ManifestError(f"{pod.name}: a {pod.role or 'unlabelled'} pod is not run on the host")


def _write_volumes(pod: HostPod, log_dir: Path) -> dict[str, str]:
    """Each ConfigMap or Secret volume as files under the log folder; mount path -> host
    path. Owner-only permissions: a Secret volume holds a private key."""
    mounts = dict(pod.plan.host_mounts)
    for target, files in pod.plan.files.items():
        folder = log_dir / "volumes" / pod.name / target.strip("/").replace("/", "_")
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
            (folder / name).chmod(0o600)
        mounts[target] = str(folder)
    return mounts


def _run_init_containers(
    pod: HostPod, mounts: Mapping[str, str], env: dict[str, str], log_dir: Path
) -> None:
    for init in pod.plan.init_containers:
        termination = log_dir / "volumes" / pod.name / f"{init.name}.termination-log"
        termination.parent.mkdir(parents=True, exist_ok=True)
        argv = [_on_host(a, mounts) for a in init_argv(pod.plan, init, str(termination))]
        with (log_dir / f"{pod.name}.log").open("ab") as log:
            done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **env, **init.env}, check=False)  # fmt: skip
        if done.returncode != 0:
            message = termination.read_text().strip() if termination.is_file() else ""
            raise HostPodsStartError(
                f"{pod.name}: init container {init.name} exited {done.returncode}: "
                f"{message or 'see ' + str(log_dir / (pod.name + '.log'))}"
            )


def _model_arg(pod: HostPod, mounts: Mapping[str, str]) -> list[str]:
    """``--model HOST_PATH`` where the config document's model path lies in a mount (the
    pod would read it there; here it is the folder that stands for the mount)."""
    argv = pod.plan.args
    if "--config" not in argv:
        return []
    config = Path(_on_host(argv[argv.index("--config") + 1], mounts))
    try:
        path = str(json.loads(config.read_text())["model"]["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    on_host = _on_host(path, mounts)
    return ["--model", on_host] if on_host != path else []


def _pod_ready(probe_url: str) -> bool:
    """The probe answers; a worker that refused its settings (it stays up, never ready)
    is an error at once, with its reason."""
    if probe_url.startswith("tcp://"):
        host, port = probe_url.removeprefix("tcp://").rsplit(":", 1)
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 1):
            return True
        return False
    if http_ok(probe_url):
        return True
    refusal = refused_settings(probe_url) if probe_url.endswith("/ready") else None
    if refusal is not None:
        raise HostPodsStartError(f"{refusal.role} refused its settings: {refusal.problem}")
    return False


def _wait_ready(running: HostPods, deadline: float) -> None:
    """Until every readiness probe (and each line's admin endpoint) answers."""
    checks: dict[str, Callable[[], bool]] = {
        line.name: functools.partial(http_ok, f"{line.admin_url}/stats") for line in running.lines
    }
    started = {c.name for c in running.supervisor.children}
    for pod in running.pods:
        url = pod.probe_url()
        if url is not None and pod.name in started:
            checks[pod.name] = functools.partial(_pod_ready, url)
    wait_ready(checks, running.supervisor, deadline, running.log_dir, HostPodsStartError)
