"""``pdd up --autoscale``'s machinery on a real stack (tiny model, pdd mode): a scripted
target scales P from 1 to 2 and back to 1 while requests run through the router. The
router learns the new worker by its own poll (its ready-instances gauge counts it, and
leaves it out once it drains); the scale-down goes through the worker's drain (exit code
0, its "drained" log line); no request fails; stack.json follows the replicas. Every wait
is on a condition, none on the clock."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import pytest

from pdd.common.vocabulary import Role
from pdd.local.autoscale import (
    TIERS,
    Autoscaler,
    AutoscaleSettings,
    Tiers,
    scrape,
    sized_config,
)
from pdd.local.cluster import free_port
from pdd.local.probes import flatten, total
from pdd.local.stack import LocalStack, StackInfo
from pdd.local.topology import StackConfig
from pdd.simulator.planner.load import ObservedLoad, Slo
from pdd.simulator.planner.planner import Decision
from pdd.simulator.planner.pools import PoolBounds
from pdd.simulator.planner.scrape import PodMetrics
from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration

READY_TIMEOUT_S = 240
CLIENTS = 3
#: P may have two workers, RLD and MD one each; a decision every tick, acted on at once
#: (no stabilization window: the script is the target).
SETTINGS = AutoscaleSettings(
    {role: PoolBounds(role, 1.0, 1, 2 if role == Role.PREFILL else 1) for role in TIERS},
    Slo(2.0, 0.2),
    interval_s=1.0,
    stabilize_s=0.0,
)


class Script:
    """The planner's stand-in: whatever replicas the test sets, every round."""

    def __init__(self) -> None:
        self.replicas = {"prefill": 1, "relay": 1, "main": 1}

    def decide(self, _scraped: Mapping[str, PodMetrics], _now: float) -> Decision:
        idle = ObservedLoad(0.0, 0.0, 0.0, 0.0, 0.0)
        return Decision(dict(self.replicas), False, 0.0, idle, {}, idle, None)


class Clients:
    """``CLIENTS`` threads sending completions, each with a prompt of its own, until
    stopped; every answer is kept (status, finish reason)."""

    def __init__(self, base_url: str) -> None:
        self.base_url, self.stop = base_url, threading.Event()
        self.results: list[tuple[int, str | None]] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(CLIENTS)]

    def _run(self, client: int) -> None:
        with httpx.Client(timeout=120.0) as http:
            for n in itertools.count():
                if self.stop.is_set():
                    return
                body = {"model": "tiny", "prompt": f"client {client} request {n} " * 8,
                        "max_tokens": 8, "temperature": 0}  # fmt: skip
                try:
                    r = http.post(f"{self.base_url}/completions", json=body)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                reason = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else None
                self.results.append((r.status_code, reason))

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[LocalStack, Tiers]]:
    config = StackConfig(
        port=free_port(), log_dir=tmp_path / "logs", ready_timeout_s=READY_TIMEOUT_S,
        worker_args=("--kv-cache-gib=0.03125",),
    )  # fmt: skip
    config, standby = sized_config(config, SETTINGS)
    assert standby == {"pdd-prefill-1"}
    started = LocalStack.start(config, lambda _line: None, standby)
    try:
        yield started, Tiers(started.pods)
    finally:
        started.stop()


def ready_in_router(router_url: str, role: str) -> float:
    """How many ``role`` workers the router's poll finds answering (and not draining)."""
    samples = flatten(httpx.get(f"{router_url}/metrics", timeout=5.0).text)
    return total(samples, "pdd_router_instances_ready", role=role)


def test_a_tier_scales_up_and_drains_back_down_under_traffic(
    stack: tuple[LocalStack, Tiers],
) -> None:
    local, tiers = stack
    script, said = Script(), []
    with httpx.Client() as http:
        scaler = Autoscaler(
            tiers, lambda: scrape(http, tiers.targets(local.config.router_url)),
            script.decide, SETTINGS, said.append, local.save_replicas,
        )  # fmt: skip
        clock = itertools.count()
        router = local.config.router_url
        stack_json = local.config.log_dir / "stack.json"
        with Clients(local.info.base_url) as clients:
            until_sync(lambda: len(clients.results) >= CLIENTS, "first answers", 120)
            script.replicas["prefill"] = 2
            scaler.tick(next(clock))
            assert "started pdd-prefill-1" in said[-1]
            assert StackInfo.load(stack_json).replicas["prefill"] == 2
            until_sync(lambda: ready_in_router(router, "prefill") == 2, "router sees 2 P", 180)
            served_before = len(clients.results)
            script.replicas["prefill"] = 1
            scaler.tick(next(clock))
            assert "draining pdd-prefill-1" in said[-1]
            assert StackInfo.load(stack_json).replicas["prefill"] == 1
            until_sync(lambda: ready_in_router(router, "prefill") == 1, "router sees 1 P", 60)

            def drained() -> bool:
                scaler.tick(next(clock))
                return any("pdd-prefill-1 exited" in line for line in said)

            until_sync(drained, "pdd-prefill-1 drained and exited", 120)
            until_sync(lambda: len(clients.results) > served_before + CLIENTS, "more answers", 120)
    exit_line = next(line for line in said if "pdd-prefill-1 exited" in line)
    assert "exited with code 0 (drained)" in exit_line
    assert "drained; nothing live" in (local.config.log_dir / "pdd-prefill-1.log").read_text()
    assert local.supervisor.deaths() == []
    assert clients.errors == []
    assert {status for status, _ in clients.results} == {200}
    assert {reason for _, reason in clients.results} <= {"length", "stop"}
