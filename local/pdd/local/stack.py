"""One local stack: what the operator renders for ``pdd up``'s flags, run on this host.

``topology.stack_deployment`` makes the PDDDeployment (written to the log folder as
``pdddeployment.yaml``), ``pdd operator render`` its manifests (``rendered/``), and
``hostnet`` runs the mode's pods as local processes with the two WAN lines between the
clusters. Every readiness probe and line must answer, then the router must count every
started worker ready (its ``/ready`` answers once a prefill and a main decode do; the
relay joins at its next poll, and a stack called up before that would serve P-MD only).
``stack.json`` in the log folder says where
everything is, so ``pdd bench --stack`` can read the counters of a stack it did not
start.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import yaml

from pdd.local.cluster import ADDRESS_IN_USE, PORT_ATTEMPTS, wait_http_ok
from pdd.local.hostnet import (
    ROUTER_COMPONENT,
    WORKER_COMPONENTS,
    HostPods,
    HostPodsStartError,
    start_host_pods,
)
from pdd.local.manifests import (
    ClusterObjects,
    HostAddressing,
    ManifestError,
    PodPlan,
    plan_pods,
)
from pdd.local.probes import Probes, by_label, flatten
from pdd.local.supervisor import PDD_PROGRAM
from pdd.local.topology import (
    StackConfig,
    extra_args,
    mode_objects,
    stack_deployment,
    user_secrets,
)

Say = Callable[[str], None]


class StackStartError(RuntimeError):
    """A component did not come up; the message names it and carries its log's tail."""


@dataclass(frozen=True)
class StackInfo:
    """Where a running stack's parts are; written to ``<log_dir>/stack.json``."""

    mode: str
    model: str
    router_url: str
    workers: dict[str, str]  # name -> http url
    links: dict[str, str]  # name of the worker behind it -> admin url
    pids: dict[str, int]
    log_dir: str
    #: Workers running per role where ``pdd up --autoscale`` sizes them (``workers`` then
    #: lists every slot the router was told of; only these many per role run).
    replicas: dict[str, int] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"{self.router_url}/v1"

    @property
    def probes(self) -> Probes:
        return Probes(self.router_url, tuple(self.workers.values()), tuple(self.links.values()))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> StackInfo:
        return cls(**json.loads(path.read_text()))


class _Ticker:
    """Prints how long a blocking step has taken, every ``every_s``, until stopped."""

    def __init__(self, say: Say, what: str, every_s: float = 5.0) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(say, what, every_s), daemon=True)

    def _run(self, say: Say, what: str, every_s: float) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(every_s):
            say(f"  ... {what} ({time.monotonic() - t0:.0f} s)")

    def __enter__(self) -> _Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class LocalStack:
    def __init__(self, config: StackConfig, pods: HostPods, info: StackInfo, secret: str) -> None:
        self.config = config
        self.pods = pods
        self.supervisor = pods.supervisor
        self.info = info
        #: The shared token the workers were given (their debug and data-plane routes).
        self.secret = secret

    @classmethod
    def start(
        cls, config: StackConfig, say: Say = print, standby: Collection[str] = ()
    ) -> LocalStack:
        """Start ``config``'s stack; the pods ``standby`` names are placed (the router is
        told of them) but not started (``pdd up --autoscale`` starts them as it scales)."""
        config.log_dir.mkdir(parents=True, exist_ok=True)
        secret = os.environ.get("PDD_SHARED_SECRET") or secrets.token_hex(16)
        plans = render(config, secret)
        model = config.model + (" (random weights: answers are noise)" if config.model == "tiny"
                                 else "")  # fmt: skip
        say(f"starting {', '.join(p.name for p in plans)} (model {model}), "
            f"logs in {config.log_dir}")  # fmt: skip
        pods = _start_pods(config, plans, say, standby)
        workers = [p for p in pods.pods if p.role != ROUTER_COMPONENT]
        started = Counter(
            p.role for p in workers if p.role in WORKER_COMPONENTS and p.name not in standby
        )
        try:
            _wait_router(config, pods, started, time.monotonic() + config.ready_timeout_s)
        except BaseException:
            pods.stop()
            raise
        for pod in workers:
            ready = "standby" if pod.name in standby else "ready"
            say(f"  {ready}: {pod.name} ({pod.role}) {pod.http_url}")
        for line in pods.lines:
            say(f"  WAN line {line.name}: admin {line.admin_url}")
        info = StackInfo(
            mode=config.mode,
            model=config.served_name,
            router_url=config.router_url,
            workers={p.name: p.http_url for p in workers},
            links={line.name: line.admin_url for line in pods.lines},
            pids=pods.supervisor.pids(),
            log_dir=str(config.log_dir),
        )
        info.save(config.log_dir / "stack.json")
        return cls(config, pods, info, secret)

    def save_replicas(self, replicas: Mapping[str, int]) -> None:
        """Record the workers running per role (and the processes' ids) in stack.json."""
        pids = self.supervisor.pids()
        self.info = replace(self.info, pids=pids, replicas=dict(replicas))
        self.info.save(self.config.log_dir / "stack.json")

    def stop(self) -> None:
        self.pods.stop()


def render(config: StackConfig, token: str) -> list[PodPlan]:
    """``config``'s PDDDeployment through ``pdd operator render`` (the operator's own
    validation and plan), then the mode's pods planned on this host; a spec the operator
    refuses, or pods the host cannot run, are a StackStartError."""
    source, out = config.log_dir / "pdddeployment.yaml", config.log_dir / "rendered"
    source.write_text(yaml.safe_dump(stack_deployment(config), sort_keys=False))
    argv = [*PDD_PROGRAM, "operator", "render", "-f", str(source), "--out-dir", str(out)]
    # The manifests, then the Secrets they name (what the operator would generate once).
    for extra in ([], ["--secrets", "--shared-token", token]):
        done = subprocess.run([*argv, *extra], capture_output=True, text=True)
        if done.returncode != 0:
            raise StackStartError(f"pdd operator render refused {source}: {done.stderr.strip()}")

    def objects(name: str) -> list[dict]:
        files = [out / f"{name}.yaml", out / f"secrets-{name}.yaml"]
        return [o for f in files if f.exists() for o in yaml.safe_load(f.read_text())["items"]]

    clusters = [
        ClusterObjects(name, objects(name))
        for name in ("local", "remote")
        if (out / f"{name}.yaml").exists()
    ]
    try:
        return plan_pods(
            mode_objects(config.mode, clusters),
            secrets=user_secrets(config),
            addressing=HostAddressing(),
        )
    except ManifestError as exc:
        raise StackStartError(str(exc)) from exc


def _start_pods(
    config: StackConfig, plans: list[PodPlan], say: Say, standby: Collection[str]
) -> HostPods:
    """Start and wait for the pods; a start that lost a port to another process (two
    suites side by side) is tried again on new ports, up to ``PORT_ATTEMPTS`` times."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            with _Ticker(say, "waiting for workers to load the model and report ready"):
                return start_host_pods(
                    plans,
                    config.log_dir,
                    link=config.link,
                    env={"OMP_NUM_THREADS": "1"},
                    extra_args=extra_args(config),
                    router_port=config.port,
                    router_host=config.host,
                    ready_timeout_s=config.ready_timeout_s,
                    standby=standby,
                )
        except HostPodsStartError as exc:
            if ADDRESS_IN_USE not in str(exc) or attempt == PORT_ATTEMPTS:
                raise StackStartError(f"a pod did not come up: {exc}") from exc
            say(f"  a port was taken meanwhile; starting again ({exc.args[0].splitlines()[0]})")
    raise AssertionError("unreachable")


def _wait_router(
    config: StackConfig, pods: HostPods, started: Mapping[str, int], deadline: float
) -> None:
    """The router answers ``/ready`` and counts, per role, every worker ``started``."""
    url = f"{config.router_url}/ready"

    def check_alive() -> None:
        for death in pods.supervisor.deaths():
            raise StackStartError(death.describe())

    def sees_every_worker() -> bool:
        seen = _router_ready_workers(config.router_url)
        return all(seen.get(role, 0) >= n for role, n in started.items())

    if not wait_http_ok(url, deadline, check_alive):
        tail = _router_log(pods)
        raise StackStartError(f"router not ready at {url} in time; its log ends:\n{tail}")
    while not sees_every_worker():
        check_alive()
        if time.monotonic() > deadline:
            seen = _router_ready_workers(config.router_url)
            raise StackStartError(
                f"the router counts {seen or 'no'} workers ready of those started "
                f"({dict(started)}) in time; its log ends:\n{_router_log(pods)}"
            )
        time.sleep(0.1)


def _router_ready_workers(router_url: str) -> dict[str, int]:
    """Per role, the workers the router counts ready (``pdd_router_instances_ready``);
    empty while its ``/metrics`` does not answer."""
    try:
        text = httpx.get(f"{router_url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return {}
    ready = by_label(flatten(text), "pdd_router_instances_ready", "role")
    return {role: int(n) for role, n in ready.items()}


def _router_log(pods: HostPods) -> str:
    names = {p.name for p in pods.of_role(ROUTER_COMPONENT)}
    router = [c for c in pods.supervisor.children if c.name in names]
    return router[0].log_tail() if router else ""
