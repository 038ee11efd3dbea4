"""One local stack: workers and WAN links (through ``LocalCluster``), then the router.

Start order is the dependency order, each step health-gated: every worker's
``/ready`` and link's ``/stats`` (LocalCluster), then the router's ``/ready`` (it
answers once it sees its workers). ``stack.json`` in the log folder says where
everything is, so ``pdd bench --stack`` can read the counters of a stack it did not
start.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pdd.local.cluster import ClusterStartError, LocalCluster, wait_http_ok
from pdd.local.probes import Probes
from pdd.local.supervisor import Supervisor, spawn_pdd
from pdd.local.topology import StackConfig, router_argv, worker_specs

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
    def __init__(self, config: StackConfig, supervisor: Supervisor, info: StackInfo) -> None:
        self.config = config
        self.supervisor = supervisor
        self.info = info

    @classmethod
    def start(cls, config: StackConfig, say: Say = print) -> LocalStack:
        config.log_dir.mkdir(parents=True, exist_ok=True)
        secret = os.environ.get("PDD_SHARED_SECRET") or secrets.token_hex(16)
        env = {"PDD_SHARED_SECRET": secret, "OMP_NUM_THREADS": "1"}
        supervisor = Supervisor()
        specs = worker_specs(config.mode, config.counts)
        say(f"starting {len(specs)} workers ({', '.join(s.name for s in specs)}), "
            f"model {config.model}, logs in {config.log_dir}")  # fmt: skip
        try:
            cluster = _start_cluster(config, specs, secret, say)
            _adopt(supervisor, cluster, config.log_dir)
            workers = [(w.spec.name, w.spec.role, w.url) for w in cluster.workers.values()]
            log = config.log_dir / "router.log"
            router = spawn_pdd(router_argv(config, workers), log, env)
            supervisor.add("router", router, log)
            say(f"starting router on {config.router_url}")
            _wait_router(config, supervisor, time.monotonic() + config.ready_timeout_s)
        except BaseException:
            supervisor.stop()
            raise
        info = StackInfo(
            mode=config.mode,
            model=config.served_name,
            router_url=config.router_url,
            workers={w.spec.name: w.url for w in cluster.workers.values()},
            links={n: w.link.admin_url for n, w in cluster.workers.items() if w.link},
            pids=supervisor.pids(),
            log_dir=str(config.log_dir),
        )
        info.save(config.log_dir / "stack.json")
        return cls(config, supervisor, info)

    def stop(self) -> None:
        self.supervisor.stop()


def _start_cluster(config: StackConfig, specs: list, secret: str, say: Say) -> LocalCluster:
    common = ("--model", config.model, *config.worker_args)
    try:
        with _Ticker(say, "waiting for workers to load the model and report ready"):
            cluster = LocalCluster.start(
                specs, config.log_dir, config.link, secret, common, config.ready_timeout_s
            )
    except ClusterStartError as exc:
        raise StackStartError(f"a worker did not come up: {exc}") from exc
    for w in cluster.workers.values():
        link = f", WAN link admin {w.link.admin_url}" if w.link else ""
        say(f"  ready: {w.spec.name} ({w.spec.role}) {w.url}{link}")
    return cluster


def _adopt(supervisor: Supervisor, cluster: LocalCluster, log_dir: Path) -> None:
    for name, w in cluster.workers.items():
        supervisor.add(name, w.proc, w.log)
        if w.link is not None:
            supervisor.add(f"{name}-wan-link", w.link.proc, w.link.log)


def _wait_router(config: StackConfig, supervisor: Supervisor, deadline: float) -> None:
    url = f"{config.router_url}/ready"

    def check_alive() -> None:
        for death in supervisor.deaths():
            raise StackStartError(death.describe())

    if not wait_http_ok(url, deadline, check_alive):
        tail = supervisor.children[-1].log_tail()
        raise StackStartError(f"router not ready at {url} in time; its log ends:\n{tail}")
