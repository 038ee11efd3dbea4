"""Run rendered manifests as local processes, each pod in its own network namespace.

What a kubelet and a pod network do, reduced to what our manifests use (see
``manifests`` for the planning): every pod gets a network namespace with its pod IP,
its own ``/etc/hosts`` (the Service names of its cluster, and of the other cluster
under the multi-cluster domain) and its volumes bind-mounted where the container
expects them (``ip netns exec`` gives each a private mount namespace); then the
container's ``command``/``args``/``env`` run unchanged. The pods of one cluster share
a bridge. The two clusters share nothing but two gateway namespaces, one per
direction a connection can start in, each running a ``pdd wan-link``: a pod that dials
a pod IP of the other cluster reaches its side's gateway (which holds those addresses
on that bridge) and the line forwards the connection to the pod's node address, so
every byte between the datacenters crosses an emulated WAN line. (One gateway cannot
serve both sides: it would hold every pod IP and so could not talk to any.) Which
ports are forwarded is the NetworkPolicy's story: A reaches B's ``http`` (the router
polls MD) and ``wan`` ports, B reaches A's ``wan`` ports only. A→B connections (KV,
the router's streams) ride the A-side line, B→A ones (MD's handoff calls) the other.

Needs root (network namespaces, bridges, bind mounts); ``PodNetworkError`` says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import shlex
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from pdd.local.cluster import LinkSpec, http_ok, wan_link_argv
from pdd.local.manifests import (
    DEFAULT_ENTRYPOINTS,
    Addressing,
    ClusterObjects,
    ManifestError,
    PodPlan,
    container_argv,
    host_table,
    hosts_file,
    init_argv,
    plan_pods,
)
from pdd.local.supervisor import Supervisor, wait_ready

#: Container ports of the other cluster's pods a gateway forwards, by the cluster whose
#: pods dial through it (cluster 0 is A).
FORWARDED_PORTS: dict[int, tuple[str, ...]] = {0: ("http", "wan"), 1: ("wan",)}
#: Where each gateway's admin endpoint listens, on its cluster's node network.
GATEWAY_ADMIN_PORT = 7999


class PodNetworkError(RuntimeError):
    """The network namespaces could not be made (not root, no netns support)."""


class PodStartError(RuntimeError):
    """A pod exited or never became ready; the message carries its log's tail."""


def run_commands(commands: Sequence[Sequence[str]]) -> None:
    for argv in commands:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise PodNetworkError(f"`{shlex.join(argv)}` failed: {done.stderr.strip()}")


@dataclass(frozen=True)
class Naming:
    """Interface and namespace names of one run (a short tag keeps them unique)."""

    tag: str

    def namespace(self, pod: str) -> str:
        return f"pdd-{self.tag}-{pod}"

    def gateway(self, side: int) -> str:
        return f"pdd-{self.tag}-wan{side}"

    def bridge(self, cluster: int) -> str:  # interface names: at most 15 characters
        return f"pd{self.tag}b{cluster}"

    def pod_veth(self, n: int) -> tuple[str, str]:
        return f"pd{self.tag}p{n}", f"pd{self.tag}q{n}"

    def gateway_veth(self, side: int, bridge: int) -> tuple[str, str]:
        return f"pd{self.tag}g{side}{bridge}", f"pd{self.tag}w{side}{bridge}"


def network_commands(
    naming: Naming, clusters: int, pods: list[PodPlan], net: Addressing
) -> list[list[str]]:
    """The ``ip`` commands that build the bridges, the pods' namespaces and the gateways."""
    cmds: list[list[str]] = []
    for c in range(clusters):
        bridge = naming.bridge(c)
        cmds += [
            ["ip", "link", "add", bridge, "type", "bridge"],
            ["ip", "link", "set", bridge, "up"],
            # The node's own address on the cluster: probes and clients come from here.
            ["ip", "addr", "add", f"{net.node(c, 254)}/24", "dev", bridge],
        ]
    for n, pod in enumerate(pods):
        ns, (host_end, pod_end) = naming.namespace(pod.name), naming.pod_veth(n)
        cmds += _attach(naming.bridge(pod.cluster_index), ns, host_end, pod_end)
        cmds += [
            ["ip", "-n", ns, "link", "set", pod_end, "name", "eth0"],
            # Pod IPs of both clusters are on-link: the other cluster's answer from the gateway.
            ["ip", "-n", ns, "addr", "add", f"{pod.pod_ip}/16", "dev", "eth0"],
            ["ip", "-n", ns, "addr", "add", f"{pod.node_ip}/24", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
    if clusters == 2:
        cmds += gateway_commands(naming, 0, pods, net) + gateway_commands(naming, 1, pods, net)
    return cmds


def _attach(bridge: str, ns: str, host_end: str, ns_end: str) -> list[list[str]]:
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end],
        ["ip", "link", "set", ns_end, "netns", ns],
        ["ip", "link", "set", host_end, "master", bridge, "up"],
        ["ip", "-n", ns, "link", "set", ns_end, "up"],
    ]


def gateway_commands(
    naming: Naming, side: int, pods: list[PodPlan], net: Addressing
) -> list[list[str]]:
    """The gateway that cluster ``side`` dials into: on that cluster's bridge it holds the
    other cluster's pod IPs (answering ARP for nothing else), on the other bridge a node
    address from which it reaches those pods' node addresses."""
    gw, far = naming.gateway(side), 1 - side
    cmds = [["ip", "netns", "add", gw], ["ip", "-n", gw, "link", "set", "lo", "up"]]
    cmds += [
        ["ip", "netns", "exec", gw, "sh", "-c", f"echo {v} > /proc/sys/net/ipv4/conf/all/{k}"]
        for k, v in (("arp_ignore", 1), ("arp_announce", 2))
    ]
    near_host, near_end = naming.gateway_veth(side, side)
    far_host, far_end = naming.gateway_veth(side, far)
    cmds += _attach(naming.bridge(side), gw, near_host, near_end)[1:]
    cmds += _attach(naming.bridge(far), gw, far_host, far_end)[1:]
    cmds += [
        ["ip", "-n", gw, "addr", "add", f"{net.node(side, 253)}/24", "dev", near_end],
        ["ip", "-n", gw, "route", "add", f"{net.pod(side, 0)}/24", "dev", near_end],
        ["ip", "-n", gw, "addr", "add", f"{net.node(far, 252)}/24", "dev", far_end],
    ]
    cmds += [
        ["ip", "-n", gw, "addr", "add", f"{p.pod_ip}/32", "dev", near_end]
        for p in pods
        if p.cluster_index == far
    ]
    return cmds


def gateway_argv(link: LinkSpec, side: int, pods: list[PodPlan], net: Addressing) -> list[str]:
    """``pdd wan-link`` for the gateway cluster ``side`` dials into: a route per forwarded
    port of each pod of the other cluster, pod IP to node address."""
    routes = [
        (f"{p.pod_ip}:{p.ports[name]}", f"{p.node_ip}:{p.ports[name]}")
        for p in pods
        if p.cluster_index != side
        for name in FORWARDED_PORTS[side]
        if name in p.ports
    ]
    if not routes:
        raise ManifestError(f"cluster {side}'s pods have no port of the other cluster to reach")
    return wan_link_argv(link, routes, f"{net.node(side, 253)}:{GATEWAY_ADMIN_PORT}")


#: Candidate first octets after 10. for pod IPs (the next one holds the node addresses).
POD_OCTETS = range(240, 64, -2)
#: One lock file per claimed pair of /16s, held while the pods run.
LOCK_DIR = Path("/run/lock")


def claim_addressing() -> tuple[Addressing, TextIO]:
    """Two /16s of 10/8 that no route of this machine uses and no other runner holds
    (a lock file per pair), so runs side by side (two test suites) never share a subnet."""
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    for octet in POD_OCTETS:
        if f"10.{octet}." in routes or f"10.{octet + 1}." in routes:
            continue
        lock = (LOCK_DIR / f"pdd-pods-10.{octet}.lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return Addressing(octet), lock
    raise PodNetworkError("no free pair of 10.x.0.0/16 subnets for the pods' addresses")


@dataclass
class RunningPods:
    """A started set of pods; ``stop()`` ends the processes and removes the network, the
    hosts files and the address claim (mount points it made stay: ``_ensure_mount_point``)."""

    pods: list[PodPlan]
    supervisor: Supervisor
    naming: Naming
    log_dir: Path
    net: Addressing
    gateway_admins: list[str] = field(default_factory=list)
    _cleanup: list[Callable[[], None]] = field(default_factory=list)

    def with_label(self, key: str, value: str) -> list[PodPlan]:
        return [p for p in self.pods if p.labels.get(key) == value]

    def stop(self) -> None:
        self.supervisor.stop()
        for step in reversed(self._cleanup):
            with contextlib.suppress(Exception):
                step()
        self._cleanup.clear()


def start_pods(
    clusters: list[ClusterObjects],
    log_dir: Path,
    *,
    link: LinkSpec,
    claims: Mapping[str, str] | None = None,
    secrets: Mapping[str, Mapping[str, str]] | None = None,
    image_env: Mapping[str, str] | None = None,
    service_domain: str = "clusterset.local",
    ready_timeout_s: float = 240.0,
    entrypoints: Mapping[str, tuple[str, ...]] = DEFAULT_ENTRYPOINTS,
) -> RunningPods:
    """Plan, wire and start every pod, then wait for each one's readiness probe."""
    if len(clusters) > 2:
        raise ManifestError("the runner knows one or two clusters, not more")
    net, lock = claim_addressing()
    pods = plan_pods(clusters, claims, secrets, net)
    log_dir.mkdir(parents=True, exist_ok=True)
    running = RunningPods(pods, Supervisor(), Naming(uuid.uuid4().hex[:4]), log_dir, net)
    running._cleanup.append(lock.close)
    try:
        _wire(running, len(clusters))
        tables = host_table(clusters, pods, service_domain)
        env = dict(image_env or {})
        if len(clusters) == 2:
            for side in (0, 1):
                _start_gateway(running, link, side)
        for pod in pods:
            _start_pod(running, pod, hosts_file(tables[pod.cluster]), env, entrypoints)
        _wait_ready(running, time.monotonic() + ready_timeout_s)
    except BaseException:
        running.stop()
        raise
    return running


def _wire(running: RunningPods, clusters: int) -> None:
    naming = running.naming
    namespaces = [naming.namespace(p.name) for p in running.pods]
    if clusters == 2:
        namespaces += [naming.gateway(0), naming.gateway(1)]

    def remove_network() -> None:
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for c in range(clusters):
            subprocess.run(["ip", "link", "del", naming.bridge(c)], capture_output=True)

    running._cleanup.append(remove_network)
    run_commands(network_commands(naming, clusters, running.pods, running.net))


def _start_pod(
    running: RunningPods,
    pod: PodPlan,
    hosts: str,
    image_env: dict[str, str],
    entrypoints: Mapping[str, tuple[str, ...]],
) -> None:
    ns = running.naming.namespace(pod.name)
    etc = Path("/etc/netns") / ns  # `ip netns exec` binds these over /etc/*
    etc.mkdir(parents=True, exist_ok=True)
    running._cleanup.append(lambda: shutil.rmtree(etc, ignore_errors=True))
    (etc / "hosts").write_text(hosts)
    binds = dict(pod.host_mounts)
    for target, files in pod.files.items():
        folder = running.log_dir / "volumes" / pod.name / target.strip("/").replace("/", "_")
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
        binds[target] = str(folder)
    for target in binds:
        _ensure_mount_point(Path(target))
    script = [f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}" for dst, src in binds.items()]
    for init in pod.init_containers:  # to completion, in order, before the container
        termination = running.log_dir / "volumes" / pod.name / f"{init.name}.termination-log"
        termination.parent.mkdir(parents=True, exist_ok=True)
        assignments = [f"{k}={v}" for k, v in init.env.items()]
        script.append(shlex.join(["env", *assignments, *init_argv(pod, init, str(termination))]))
    script.append(f"exec {shlex.join(container_argv(pod, entrypoints))}")
    log = running.log_dir / f"{pod.name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, "sh", "-c", " && ".join(script)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**image_env, **pod.env},
        )
    running.supervisor.add(pod.name, proc, log)


def _ensure_mount_point(path: Path) -> None:
    """Bind mounts need an existing target. One made here stays (empty) afterwards:
    removing it would detach the bind mounts of every other run using it, since an
    ``rmdir`` of a mount point takes its mounts away in every mount namespace."""
    path.mkdir(parents=True, exist_ok=True)


def _start_gateway(running: RunningPods, link: LinkSpec, side: int) -> None:
    log = running.log_dir / f"wan-gateway-{side}.log"
    argv = [sys.executable, "-m", "pdd.cli", *gateway_argv(link, side, running.pods, running.net)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", running.naming.gateway(side), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    running.supervisor.add(f"wan-gateway-{side}", proc, log)
    running.gateway_admins.append(f"http://{running.net.node(side, 253)}:{GATEWAY_ADMIN_PORT}")


def _wait_ready(running: RunningPods, deadline: float) -> None:
    """Until every readiness probe (and the gateway's admin endpoint) answers."""
    checks: dict[str, Callable[[], bool]] = {
        p.name: functools.partial(_probe_ok, p) for p in running.pods if p.probe is not None
    }
    for side, admin in enumerate(running.gateway_admins):
        checks[f"wan-gateway-{side}"] = functools.partial(http_ok, f"{admin}/stats")
    wait_ready(checks, running.supervisor, deadline, running.log_dir, PodStartError)


def _probe_ok(pod: PodPlan) -> bool:
    assert pod.probe is not None
    if pod.probe.path is None:
        with (
            contextlib.suppress(OSError),
            socket.create_connection((pod.node_ip, pod.probe.port), timeout=1),
        ):
            return True
        return False
    return http_ok(pod.probe.url(pod.node_ip, pod.probe.port))
