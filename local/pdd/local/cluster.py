"""Worker processes and WAN link emulators on loopback, for ``pdd up``, tests and benchmarks.

Each worker runs as its own ``pdd worker`` process. A worker that receives
traffic across the WAN (main decode from P, relay from MD) gets a ``pdd
wan-link`` process in front of its data port, and advertises that as its
``wan_addr``; its ``fast_addr`` is the data port itself. So exactly the WAN
traffic goes through an emulated line that a test can throttle or cut.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from pdd.common.settings import same_setting
from pdd.common.wan_line import WanLine, line_argv
from pdd.common.wire import Endpoint, PipelinePlan, SamplingSpec, StateReport, WorkerRefusal
from pdd.local.probes import flatten
from pdd.local.supervisor import Supervisor, spawn_pdd

HOST = "127.0.0.1"


#: ``free_port`` hands out a port that another process (a second suite, the other pytest
#: worker) may bind before the worker does; such a start is tried again on new ports.
PORT_ATTEMPTS = 3
ADDRESS_IN_USE = "address already in use"


class ClusterStartError(RuntimeError):
    """A process did not come up; the message carries the tail of its log."""


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str
    wan_facing: bool = False  # put a WAN link emulator in front of its data port
    args: tuple[str, ...] = ()


class LinkSpec(WanLine):
    """A WAN line of a local stack (``pdd up``, ``pdd bench``, the tests): the line's settings,
    with a cut that resets its connections after one second rather than the emulator's five,
    so a partition a test or a chaos run makes turns into LinkDown promptly."""

    partition_grace_s: float = same_setting(WanLine.model_fields["partition_grace_s"], default=1.0)


def wan_link_argv(link: LinkSpec, routes: Sequence[tuple[str, str]], admin: str) -> list[str]:
    """``pdd wan-link`` arguments for one line carrying every (listen, to) route in
    ``routes``: they share its rate, delay and partition switch; its jitter seeded, so a
    run's delays are the same each time."""
    if not routes:
        raise ValueError("a WAN line needs at least one route")
    (listen, to), rest = routes[0], routes[1:]
    argv = ["wan-link", "--listen", listen, "--to", to, "--admin", admin]
    argv += [*line_argv(link), "--seed", "0"]
    for listen, to in rest:
        argv += ["--route", f"{listen}={to}"]
    return argv


# Ports handed to processes that bind them later come from just below the kernel's
# ephemeral range (ip_local_port_range), from which every outgoing connection on the
# machine takes its local port: a port from inside it can be taken by anyone's
# connect() between our check and the process's bind. Drawn at random (from the OS's
# entropy: pytest-randomly seeds ``random`` alike in every pytest worker) and never
# twice by one process, so two suites side by side rarely draw the same.
LISTEN_PORTS_SPAN = 12000
_draw = random.SystemRandom()
_handed_out: set[int] = set()


def free_port() -> int:
    """A port on HOST that was free a moment ago and lies outside the ephemeral range."""
    top = ephemeral_range()[0]
    low = max(1024, top - LISTEN_PORTS_SPAN)
    if len(_handed_out) > (top - low) // 2:
        _handed_out.clear()  # a long session: forget the oldest draws
    for _ in range(100):
        port = _draw.randrange(low, top)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # everything drawn was busy: let the kernel choose
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; else its default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


@dataclass
class WanLinkProc:
    proc: subprocess.Popen
    admin_url: str
    log: Path

    def set_rate(self, gbps: float) -> None:
        httpx.post(f"{self.admin_url}/rate", json={"gbps": gbps}).raise_for_status()

    def partition(self, cut: bool) -> None:
        httpx.post(f"{self.admin_url}/partition", json={"cut": cut}).raise_for_status()

    def stats(self) -> dict:
        """The emulator's counters: ``forward`` carries bytes toward the worker."""
        return httpx.get(f"{self.admin_url}/stats").json()


@dataclass
class WorkerProc:
    spec: WorkerSpec
    endpoint: Endpoint
    proc: subprocess.Popen
    log: Path
    link: WanLinkProc | None = None

    @property
    def url(self) -> str:
        return self.endpoint.http_url

    def metrics(self) -> dict[str, float]:
        """Every sample of ``/metrics``, keyed ``name{label="v",...}`` (or bare name)."""
        return flatten(httpx.get(f"{self.url}/metrics").text)

    def state(self, secret: str) -> StateReport:
        resp = httpx.get(
            f"{self.url}/v1/pdd/debug/state", headers={"Authorization": f"Bearer {secret}"}
        )
        resp.raise_for_status()
        return StateReport.model_validate(resp.json())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class PlanBuilder:
    """``plan()`` for a cluster whose ``workers`` map names to things with an ``endpoint``."""

    workers: Mapping[str, Any]

    def plan(
        self,
        request_id: str,
        prompt_ids: list[int],
        pipeline: str = "P-RLD-MD",
        sampling: SamplingSpec | None = None,
        prefill: str = "p",
        relay: str = "rld",
        main: str = "md",
        **kwargs: object,
    ) -> PipelinePlan:
        eps = {
            "prefill": self.workers[prefill].endpoint if prefill in self.workers else None,
            "relay": self.workers[relay].endpoint if relay in self.workers else None,
            "main": self.workers[main].endpoint if main in self.workers else None,
        }
        # Validated from plain values: callers name the pipeline as a string and set any
        # other PipelinePlan field through kwargs.
        return PipelinePlan.model_validate(
            {
                "request_id": request_id,
                "prompt_ids": prompt_ids,
                "pipeline": pipeline,
                "sampling": sampling or SamplingSpec(),
                **eps,
                **kwargs,
            }
        )


@dataclass
class LocalCluster(PlanBuilder):
    """Workers (and the WAN link emulators in front of them) as ``pdd`` processes, run by
    one ``Supervisor``: the process runner ``pdd up`` uses."""

    secret: str
    workers: dict[str, WorkerProc] = field(default_factory=dict)
    supervisor: Supervisor = field(default_factory=Supervisor)

    def __getitem__(self, name: str) -> WorkerProc:
        return self.workers[name]

    @classmethod
    def start(
        cls,
        specs: Sequence[WorkerSpec],
        log_dir: Path,
        link: LinkSpec | None = None,
        secret: str = "pdd-local-secret",
        common_args: Sequence[str] = (),
        ready_timeout_s: float = 120.0,
    ) -> LocalCluster:
        cluster = cls(secret)
        env = {"PDD_SHARED_SECRET": secret, "OMP_NUM_THREADS": "1"}

        def launch(spec: WorkerSpec) -> WorkerProc:
            worker = _start_worker(spec, log_dir, env, link, common_args)
            cluster.supervisor.add(spec.name, worker.proc, worker.log, env)
            if worker.link is not None:
                cluster.supervisor.add(_link_name(spec), worker.link.proc, worker.link.log, env)
            return worker

        try:
            for spec in specs:
                cluster.workers[spec.name] = launch(spec)
            cluster._wait_ready(time.monotonic() + ready_timeout_s, launch)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _wait_ready(self, deadline: float, launch: Callable[[WorkerSpec], WorkerProc]) -> None:
        """Each worker (and its link) ready; one that lost its port to another process
        is started again on new ports, up to ``PORT_ATTEMPTS`` times."""
        for name in list(self.workers):
            for attempt in range(1, PORT_ATTEMPTS + 1):
                w = self.workers[name]
                try:
                    _wait_http(f"{w.url}/ready", w.proc, w.log, deadline)
                    if w.link is not None:
                        _wait_http(f"{w.link.admin_url}/stats", w.link.proc, w.link.log, deadline)
                    break
                except ClusterStartError as exc:
                    if ADDRESS_IN_USE not in str(exc) or attempt == PORT_ATTEMPTS:
                        raise
                    names = {name, _link_name(w.spec)}
                    self.supervisor.stop(names=names)
                    self.supervisor.forget(names)
                    self.workers[name] = launch(w.spec)

    def wait_quiescent(self, timeout_s: float = 30.0) -> dict[str, StateReport]:
        """Wait until no worker holds request state, locks or blocks; the last reports."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [w for w in self.workers.values() if w.proc.poll() is None]
            states = {w.spec.name: w.state(self.secret) for w in alive}
            if all(s.quiescent for s in states.values()) or time.monotonic() > deadline:
                return states
            time.sleep(0.05)

    def stop(self) -> None:
        self.supervisor.stop()


def _link_name(spec: WorkerSpec) -> str:
    return f"{spec.name}-wan-link"


def _start_worker(
    spec: WorkerSpec,
    log_dir: Path,
    env: dict[str, str],
    link: LinkSpec | None,
    common: Sequence[str],
) -> WorkerProc:
    if spec.wan_facing and link is None:
        raise ValueError(f"worker {spec.name!r} faces the WAN: pass its line (link=LinkSpec)")
    http, data = free_port(), free_port()
    wan_link = None
    wan_addr = f"{HOST}:{data}"
    if spec.wan_facing and link is not None:
        listen, admin = free_port(), free_port()
        link_log = log_dir / f"{_link_name(spec)}.log"
        argv = wan_link_argv(link, [(f"{HOST}:{listen}", f"{HOST}:{data}")], f"{HOST}:{admin}")
        wan_link = WanLinkProc(spawn_pdd(argv, link_log, env), f"http://{HOST}:{admin}", link_log)
        wan_addr = f"{HOST}:{listen}"
    log = log_dir / f"{spec.name}.log"
    argv = [
        "worker", "--role", spec.role, "--instance-id", spec.name,
        "--http", f"{HOST}:{http}", "--data", f"{HOST}:{data}",
        "--advertise-fast", f"{HOST}:{data}", "--advertise-wan", wan_addr,
        *common, *spec.args,
    ]  # fmt: skip
    endpoint = Endpoint(
        instance_id=spec.name,
        http_url=f"http://{HOST}:{http}",
        fast_addr=f"{HOST}:{data}",
        wan_addr=wan_addr,
    )
    return WorkerProc(spec, endpoint, spawn_pdd(argv, log, env), log, wan_link)


def refused_settings(ready_url: str) -> WorkerRefusal | None:
    """The refusal of a worker that stays up without its engine (see WorkerRefusal), if
    the worker behind ``ready_url`` is one: such a worker will never become ready."""
    try:
        # A refused worker serves its reason in plaintext, even where its port is https
        # when it runs (MD with WAN TLS on): it may have no usable certificate.
        base = ready_url.removesuffix("/ready").replace("https://", "http://", 1)
        answer = httpx.get(f"{base}/health", timeout=2.0)
        if answer.status_code == 503:
            return WorkerRefusal.model_validate_json(answer.content)
    except (httpx.HTTPError, ValidationError):
        pass
    return None


def http_ok(url: str) -> bool:
    """One try: does ``url`` answer 200 now (a refused or timed-out call is a no).

    An https URL is a probe of MD's control API with WAN TLS on: like kubelet's HTTPS
    probes, this checks no certificate (the router is what verifies it)."""
    try:
        return httpx.get(url, timeout=2.0, verify=False).status_code == 200
    except httpx.HTTPError:
        return False


def wait_http_ok(url: str, deadline: float, check_alive: Callable[[], None]) -> bool:
    """Poll ``url`` until it answers 200 (True) or ``deadline`` passes (False).

    ``check_alive`` runs before every try and raises when the process behind ``url``
    died, so a crash surfaces at once with its log instead of after the deadline.
    """
    while True:
        check_alive()
        if http_ok(url):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _wait_http(url: str, proc: subprocess.Popen, log: Path, deadline: float) -> None:
    def check_alive() -> None:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise ClusterStartError(f"{proc.args!r} exited with {proc.returncode}:\n{tail}")
        refusal = refused_settings(url) if url.endswith("/ready") else None
        if refusal is not None:
            raise ClusterStartError(f"{refusal.role} refused its settings: {refusal.problem}")

    if not wait_http_ok(url, deadline, check_alive):
        raise ClusterStartError(f"{url} not ready in time; log {log}")
