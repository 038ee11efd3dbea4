"""``pdd up --autoscale`` without processes: the planner's decisions on scripted metrics
and a fake clock, the slots a tier scales through (fake processes), and the flags."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from pdd.common.vocabulary import COMPONENT_LABEL, Role
from pdd.local.autoscale import (
    AutoscaleError,
    Autoscaler,
    AutoscaleSettings,
    Tiers,
    add_autoscale_flags,
    decision_line,
    drained_line,
    planner_round,
    settings_from_args,
    sized_config,
    why,
)
from pdd.local.hostnet import HostPod, HostPods
from pdd.local.manifests import PodPlan
from pdd.local.supervisor import Child, Death, Supervisor
from pdd.local.topology import Counts, StackConfig
from pdd.router.metrics import RouterMetrics
from pdd.simulator.planner.load import ObservedLoad, Slo
from pdd.simulator.planner.model_file import load_model
from pdd.simulator.planner.planner import Decision, Planner
from pdd.simulator.planner.pools import PoolBounds
from pdd.simulator.planner.scrape import ROUTER, PodMetrics, parse_exposition
from pdd.worker.metrics import WorkerMetrics

pytestmark = pytest.mark.unit

SLO = Slo(ttft_p90_s=2.0, itl_p90_s=0.2)


def settings(interval_s: float = 10.0, most: int = 2) -> AutoscaleSettings:
    bounds = {role: PoolBounds(str(role), 1.0, 1, most) for role in Role if role != Role.MONO}
    return AutoscaleSettings(bounds, SLO, interval_s)


class Traffic:
    """The router's and a P's metrics as traffic drives them; a scrape reads them as text."""

    def __init__(self) -> None:
        self.router = RouterMetrics()
        self.prefill = WorkerMetrics("prefill")
        self.scrapes = 0

    def serve(self, n: int, ttft_s: float, queued_s: float = 0.0) -> None:
        """``n`` requests, each ``queued_s`` in P's queue of its ``ttft_s``."""
        for _ in range(n):
            self.router.requests.labels("P-MD", "test").inc()
            self.router.tokens.labels("main").inc(16)
            self.router.ttft.observe(ttft_s)
            self.router.itl.observe(0.01)
            self.prefill.queue_time.labels("prefill").observe(queued_s)

    def scrape(self) -> dict[str, PodMetrics]:
        self.scrapes += 1
        p = "pdd-prefill-0"
        return {ROUTER: parse_exposition(self.router.render().decode(), ROUTER, ROUTER),
                p: parse_exposition(self.prefill.render().decode(), p, "prefill")}  # fmt: skip


class FakeTiers:
    """Counts as :class:`Tiers` keeps them; records what it was told."""

    def __init__(self) -> None:
        self.replicas = {"prefill": 1, "relay": 1, "main": 1}

    def counts(self) -> dict[str, int]:
        return dict(self.replicas)

    def scale(self, role: Role, replicas: int) -> list[str]:
        was, self.replicas[str(role)] = self.replicas[str(role)], replicas
        return [] if was == replicas else [f"{role} {was} -> {replicas}"]

    def reap(self) -> list[Death]:
        return []

    def draining(self) -> bool:
        return False


def test_a_ttft_miss_scales_p_up_within_its_bound_and_comfort_brings_it_back() -> None:
    """The planner on the published step model, fed the router's metrics on a fake clock:
    one interval whose client TTFT P90 misses the SLO grows P (to its max, 2), and calm
    intervals after bring it back to 1; every decision is one log line saying why."""
    traffic, tiers, said = Traffic(), FakeTiers(), []
    s = settings()
    scaler = Autoscaler(tiers, traffic.scrape, planner_round(s, 0.05, 0.03).step, s, said.append)
    assert scaler.tick(0.0) is None  # the first scrape is the baseline
    traffic.serve(20, ttft_s=8.0, queued_s=6.0)
    assert scaler.tick(9.9) is None and traffic.scrapes == 1  # not an interval yet
    decision = scaler.tick(10.0)
    assert decision is not None and tiers.replicas == {"prefill": 2, "relay": 1, "main": 1}
    assert "prefill 2 (was 1)" in said[-2] and "TTFT p90 over the SLO (prefill's" in said[-2]
    assert "2.00 req/s" in said[-2] and said[-1] == "autoscale: prefill 1 -> 2"
    now = 10.0
    while tiers.replicas["prefill"] == 2:
        now += 10.0
        assert now < 1000, "P never scaled back down"
        traffic.serve(20, ttft_s=0.05)
        scaler.tick(now)
    assert tiers.replicas == {"prefill": 1, "relay": 1, "main": 1}
    assert "prefill 1 (was 2)" in said[-2]


def test_a_quiet_interval_inside_the_stabilization_window_scales_nothing_down() -> None:
    """Arrivals in bursts (a trace's timestamps every few seconds) leave some intervals
    empty: the planner then wants P's minimum, and without HPA's window P would flap."""
    traffic, tiers, said = Traffic(), FakeTiers(), []
    s = dataclasses.replace(settings(), stabilize_s=30.0)
    scaler = Autoscaler(tiers, traffic.scrape, planner_round(s, 0.05, 0.03).step, s, said.append)
    scaler.tick(0.0)
    traffic.serve(20, ttft_s=8.0, queued_s=6.0)
    scaler.tick(10.0)
    assert tiers.replicas["prefill"] == 2
    decision = scaler.tick(20.0)  # nothing arrived
    assert decision is not None and decision.replicas["prefill"] == 1
    assert tiers.replicas["prefill"] == 2 and "prefill 1 (holding 2: stabilization)" in said[-1]
    scaler.tick(30.0)
    scaler.tick(40.0)
    assert tiers.replicas["prefill"] == 2  # 2 was wanted at 10 s, within 30 s of 40 s
    scaler.tick(50.0)
    assert tiers.replicas["prefill"] == 1 and "prefill 1 (was 2)" in said[-2]


def test_a_ttft_miss_with_nothing_queued_scales_nothing_and_says_so() -> None:
    """Issue 59's runs 4 and 5: a TTFT miss while P's queue held nobody (the line, the
    handoffs, a CPU-starved machine) is no pool's to fix; the line says so."""
    traffic, tiers, said = Traffic(), FakeTiers(), []
    s = settings()
    scaler = Autoscaler(tiers, traffic.scrape, planner_round(s, 0.05, 0.03).step, s, said.append)
    scaler.tick(0.0)
    traffic.serve(20, ttft_s=8.0, queued_s=0.004)
    assert scaler.tick(10.0) is not None
    assert tiers.replicas == {"prefill": 1, "relay": 1, "main": 1}
    assert "with no pool queued" in said[-1] and "headroom" not in said[-1]


def test_without_the_routers_metrics_nothing_is_scaled() -> None:
    """No data is not zero load: a round where the router did not answer decides nothing."""
    tiers, s = FakeTiers(), settings(interval_s=1.0)
    tiers.replicas["prefill"] = 2
    scaler = Autoscaler(tiers, dict, planner_round(s, 0.05, 0.03).step, s, print)
    for now in (0.0, 1.0, 2.0, 3.0):
        assert scaler.tick(now) is None
    assert tiers.replicas["prefill"] == 2


class FakeProc:
    """A child process that exits when told to."""

    _next_pid = 1000

    def __init__(self) -> None:
        FakeProc._next_pid += 1
        self.pid, self.returncode = FakeProc._next_pid, None
        self.terminated = False

    def poll(self) -> int | None:
        return self.returncode

    def terminate(self) -> None:
        self.terminated = True


class FakePods(HostPods):
    """HostPods whose ``start_pod`` adds a fake process instead of starting one."""

    started: list[tuple[str, bool]]

    def start_pod(self, pod: HostPod, append: bool = False) -> None:
        self.started.append((pod.name, append))
        self.supervisor.add(pod.name, FakeProc(), self.log_dir / f"{pod.name}.log")  # type: ignore[arg-type]


def fake_pods(tmp_path: Path, running: Mapping[str, int], slots: int = 3) -> FakePods:
    pods = []
    for role in ("prefill", "relay", "main"):
        for i in range(slots):
            plan = PodPlan(f"pdd-{role}-{i}", "local", 0, len(pods), {COMPONENT_LABEL: role},
                           "pdd:local", (), (), {}, {"http": 8000}, None)  # fmt: skip
            pods.append(HostPod(plan, {"http": 9000 + len(pods)}))
    host = FakePods(pods, [], Supervisor(), tmp_path)
    host.started = []
    for role, n in running.items():
        for i in range(n):
            host.supervisor.add(f"pdd-{role}-{i}", FakeProc(), tmp_path / "x.log")  # type: ignore[arg-type]
    return host


def test_scale_down_retires_the_newest_and_its_slot_waits_for_its_exit(tmp_path: Path) -> None:
    host = fake_pods(tmp_path, {"prefill": 1, "relay": 1, "main": 1})
    tiers = Tiers(host)
    assert tiers.counts() == {"prefill": 1, "relay": 1, "main": 1}
    assert tiers.scale(Role.PREFILL, 3) == ["started pdd-prefill-1", "started pdd-prefill-2"]
    assert tiers.scale(Role.PREFILL, 1) == ["draining pdd-prefill-2", "draining pdd-prefill-1"]
    procs = {c.name: c.proc for c in host.supervisor.children}
    assert procs["pdd-prefill-2"].terminated and not procs["pdd-prefill-0"].terminated
    assert tiers.counts()["prefill"] == 1
    # Still draining: no slot is free, so a scale-up waits.
    assert tiers.scale(Role.PREFILL, 2) == ["prefill: no free slot (a worker still drains)"]
    procs["pdd-prefill-2"].returncode = 0  # its drain ended
    assert host.supervisor.deaths() == []  # an expected exit is no death
    assert [d.child.name for d in tiers.reap()] == ["pdd-prefill-2"]
    assert tiers.scale(Role.PREFILL, 2) == ["started pdd-prefill-2"]
    assert host.started[-1] == ("pdd-prefill-2", True)  # its log goes on
    targets = tiers.targets("http://127.0.0.1:8080")
    assert set(targets) == {ROUTER, "pdd-prefill-0", "pdd-prefill-2", "pdd-relay-0", "pdd-main-0"}


def test_a_running_worker_that_dies_is_still_a_death(tmp_path: Path) -> None:
    host = fake_pods(tmp_path, {"prefill": 2, "relay": 1, "main": 1})
    Tiers(host).scale(Role.PREFILL, 1)
    procs = {c.name: c.proc for c in host.supervisor.children}
    procs["pdd-prefill-0"].returncode = 1
    assert [d.child.name for d in host.supervisor.deaths()] == ["pdd-prefill-0"]


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_autoscale_flags(p)
    return p.parse_args(list(argv))


def test_flags_become_bounds_and_bad_ones_name_the_flag() -> None:
    got = settings_from_args(parse("--autoscale-max-main", "3", "--slo-ttft-p90-s", "1.5"), "pdd")
    assert got.bounds[Role.MAIN] == PoolBounds("main", 1.0, 1, 3)
    assert got.slo == Slo(1.5, 0.2) and got.interval_s == 10.0
    with pytest.raises(AutoscaleError, match="--mode pdd, not naive"):
        settings_from_args(parse(), "naive")
    for argv, says in [
        (("--autoscale-min-prefill", "0"), "--autoscale-min-prefill"),
        (("--autoscale-min-main", "3"), "minReplicas <= maxReplicas"),
        (("--slo-itl-p90-s", "0"), "SLO targets must be positive"),
        (("--autoscale-interval-s", "nan"), "--autoscale-interval-s"),
        (("--autoscale-stabilize-s", "-1"), "--autoscale-stabilize-s"),
    ]:
        with pytest.raises(AutoscaleError, match=says):
            settings_from_args(parse(*argv), "pdd")


def test_the_stack_is_rendered_at_each_maximum_with_the_rest_standby() -> None:
    s = settings(most=3)
    config = StackConfig(counts=Counts(prefill=2, relay=5, main=1))
    sized, standby = sized_config(config, s)
    assert sized.counts == Counts(prefill=3, relay=3, main=3)
    assert standby == {"pdd-prefill-2", "pdd-main-1", "pdd-main-2"}
    assert dataclasses.replace(sized, counts=config.counts) == config


class Foresees:
    """A predictor that expects ``ahead`` whatever was observed."""

    def __init__(self, ahead: ObservedLoad) -> None:
        self.ahead = ahead

    def predict(self, history: Sequence[ObservedLoad]) -> ObservedLoad:
        return self.ahead


def test_why_names_the_pool_the_planner_blamed_on_what_it_observed() -> None:
    """The planner grows the headroom of the pool that queued in the interval it observed;
    its reason names that pool, not the one the predicted load would blame."""
    observed = ObservedLoad(2.0, 100.0, 16.0, 0.0, 0.0, prefill_queue_p90_s=1.5,
                            main_queue_p90_s=0.0, ttft_p90_s=4.0, itl_p90_s=0.01)  # fmt: skip
    ahead = dataclasses.replace(observed, prefill_queue_p90_s=0.0, main_queue_p90_s=1.5)
    s = settings()
    model = load_model(s.scenario, 0.05, 0.03)
    pools = {str(role): s.bounds[role] for role in (Role.PREFILL, Role.RELAY, Role.MAIN)}
    decision = Planner(model, pools, SLO, Foresees(ahead)).observe(observed)
    assert decision.headroom["prefill"] > 1.0 == decision.headroom["main"]
    assert "TTFT p90 over the SLO (prefill's queue)" in why(decision, SLO)


def test_the_decision_line_reads_nan_as_not_measured() -> None:
    load = ObservedLoad(0.0, 0.0, 0.0, 0.0, 0.0)
    decision = Decision({"prefill": 1, "relay": 1, "main": 1}, False, 0.0, load, {}, load, None)
    ones = {"prefill": 1, "relay": 1, "main": 1}
    line = decision_line(decision, ones, ones, SLO)
    assert "TTFT p90 n/a" in line and "nan" not in line


@pytest.mark.parametrize(
    ("code", "log", "says"),
    [
        (0, "pdd-prefill-1: drained; nothing live\n", "exited with code 0 (drained)"),
        (0, "drain deadline (30 s) reached with 2 requests live\n", "requests cut"),
        (1, "Traceback ...\n", "exited with code 1 (not a clean drain"),
    ],
)
def test_how_a_drain_ended_is_read_from_the_exit_and_the_log(
    tmp_path: Path, code: int, log: str, says: str
) -> None:
    (tmp_path / "w.log").write_text(log)
    child = Child("pdd-prefill-1", FakeProc(), tmp_path / "w.log")  # type: ignore[arg-type]
    assert says in drained_line(Death(child, code))
