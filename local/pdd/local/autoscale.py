"""``pdd up --autoscale``: the SLO planner sizes the local stack's P, RLD and MD tiers.

The same planner the operator runs (:class:`~pdd.simulator.planner.scrape.PlannerRound`
over the simulator's :class:`~pdd.simulator.planner.planner.Planner`): every interval it
scrapes the router's and the running workers' ``/metrics``, and the interval's load and
latencies give the replicas per tier, within the bounds given on the command line.

The stack is rendered with each tier's maximum, so the router is told every worker slot
at its start and learns which ones answer by its own poll, as it does with a cluster's
pods; only the first replicas start (:class:`Tiers`). A scale-up starts a slot's worker
as ``pdd up`` starts any (the same command line); a scale-down SIGTERMs the newest
worker of the tier, which drains (the router leaves it out, its requests finish) and is
forgotten once it exited. Each decision is one log line (:func:`decision_line`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import httpx

from pdd.common.vocabulary import Role
from pdd.local.hostnet import HostPod, HostPods
from pdd.local.stack import LocalStack
from pdd.local.supervisor import Death
from pdd.local.topology import Counts, StackConfig, mode_workers
from pdd.simulator.planner.load import LoadError, Slo
from pdd.simulator.planner.model_file import load_model
from pdd.simulator.planner.planner import Decision, Planner
from pdd.simulator.planner.pools import PoolBounds
from pdd.simulator.planner.scrape import (
    ROUTER,
    MetricsError,
    PlannerRound,
    PodMetrics,
    parse_exposition,
)
from pdd.simulator.planner.stabilize import Stabilizer

log = logging.getLogger(__name__)

#: The tiers the planner sizes, by their worker role (the planner's pool names).
TIERS: tuple[Role, ...] = (Role.PREFILL, Role.RELAY, Role.MAIN)
#: A process answers /metrics from its event loop; a slow one is left out of this round.
SCRAPE_TIMEOUT_S = 5.0
#: What a worker logs when its drain ran out of time with requests still live.
DRAIN_CUT = "drain deadline"
#: How an exit line says so.
DRAINS_CUT = "drain ran out of time"

#: One round's scrape: pod name -> its metrics.
Scrape = Callable[[], dict[str, PodMetrics]]
#: The planner's step: a scrape and its time in, a decision (or none yet) out.
Decide = Callable[[Mapping[str, PodMetrics], float], Decision | None]
Say = Callable[[str], None]


class AutoscaleError(ValueError):
    """Bounds or targets ``pdd up --autoscale`` cannot run with; the message names the flag."""


@dataclass(frozen=True)
class AutoscaleSettings:
    """``--autoscale-min-ROLE``/``--autoscale-max-ROLE``, the SLO, the interval and the
    scenario whose step model the planner sizes with."""

    bounds: Mapping[Role, PoolBounds]
    slo: Slo
    interval_s: float = 10.0
    scenario: str = "published"
    #: HPA's scale-down stabilization window, which the operator's decisions pass through.
    stabilize_s: float = 300.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise AutoscaleError(f"--autoscale-interval-s must be > 0, got {self.interval_s}")
        if not (math.isfinite(self.stabilize_s) and self.stabilize_s >= 0):
            raise AutoscaleError(f"--autoscale-stabilize-s must be >= 0, got {self.stabilize_s}")
        for role in (Role.PREFILL, Role.MAIN):  # every request needs one of each
            if self.bounds[role].min_replicas < 1:
                raise AutoscaleError(f"--autoscale-min-{role} must be at least 1")

    def initial(self, role: Role, asked: int) -> int:
        """The replicas a tier starts with: ``asked`` (``--ROLE N``) within its bounds."""
        return self.bounds[role].clamp(asked)


def planner_round(settings: AutoscaleSettings, line_gbps: float, rtt_s: float) -> PlannerRound:
    """The planner on the scenario's step model and the stack's own line."""
    model = load_model(settings.scenario, line_gbps, rtt_s)
    pools = {str(role): settings.bounds[role] for role in TIERS}
    return PlannerRound(Planner(model, pools, settings.slo))


class Tiers:
    """The stack's worker slots per tier: those running (in start order) and the rest.

    ``scale`` starts the first free slot's worker (the same command line each time, so
    the router, told of every slot, finds it where it expects it) or retires the newest
    running one; a slot still draining is not free until it exited (``reap``)."""

    def __init__(self, pods: HostPods) -> None:
        self.pods = pods
        started = {c.name for c in pods.supervisor.children}
        self.slots = {role: pods.of_role(role) for role in TIERS}
        self.running = {role: [p for p in self.slots[role] if p.name in started] for role in TIERS}
        self._ever_started = set(started)

    def counts(self) -> dict[str, int]:
        """Running (not draining) workers per tier."""
        return {str(role): len(self.running[role]) for role in TIERS}

    def scale(self, role: Role, replicas: int) -> list[str]:
        """Start or retire ``role``'s workers toward ``replicas``; what was done, one
        phrase per worker."""
        done = []
        running = self.running[role]
        while len(running) < replicas:
            free = self._free_slot(role)
            if free is None:
                done.append(f"{role}: no free slot (a worker still drains)")
                break
            self.pods.start_pod(free, append=free.name in self._ever_started)
            self._ever_started.add(free.name)
            running.append(free)
            done.append(f"started {free.name}")
        while len(running) > max(replicas, 0):
            newest = running.pop()
            self.pods.supervisor.retire(newest.name)
            done.append(f"draining {newest.name}")
        return done

    def _free_slot(self, role: Role) -> HostPod | None:
        busy = {p.name for p in self.running[role]} | self.pods.supervisor.retiring()
        return next((p for p in self.slots[role] if p.name not in busy), None)

    def reap(self) -> list[Death]:
        """Retired workers that exited since the last call (their slots free again)."""
        return self.pods.supervisor.retired()

    def draining(self) -> bool:
        """Whether a retired worker has not exited yet."""
        return bool(self.pods.supervisor.retiring())

    def targets(self, router_url: str) -> dict[str, tuple[str, str]]:
        """``name -> (role, /metrics URL)`` of the router and every running worker."""
        out = {ROUTER: (ROUTER, f"{router_url}/metrics")}
        for role in TIERS:
            for pod in self.running[role]:
                out[pod.name] = (str(role), f"{pod.http_url}/metrics")
        return out


def scrape(http: httpx.Client, targets: Mapping[str, tuple[str, str]]) -> dict[str, PodMetrics]:
    """Every target's metrics; one that does not answer (just started, or gone) is left
    out of this round. No certificate is checked: MD's port serves TLS with WAN TLS on,
    and this is the node's own probe, as kubelet's is."""
    found = {}
    for name, (role, url) in targets.items():
        try:
            answer = http.get(url, timeout=SCRAPE_TIMEOUT_S)
            answer.raise_for_status()
            found[name] = parse_exposition(answer.text, name, role)
        except (httpx.HTTPError, MetricsError) as exc:
            log.debug("autoscale: no metrics from %s: %s", name, exc)
    return found


class Scaler(Protocol):
    """What the loop drives (:class:`Tiers`; tests give a recording stand-in)."""

    def counts(self) -> dict[str, int]: ...

    def scale(self, role: Role, replicas: int) -> list[str]: ...

    def reap(self) -> list[Death]: ...

    def draining(self) -> bool: ...


def _fmt(value: float, unit: str = "") -> str:
    return "n/a" if math.isnan(value) else f"{value:.3g}{unit}"


def decision_line(
    decision: Decision, before: Mapping[str, int], applied: Mapping[str, int], slo: Slo
) -> str:
    """One line: the load the planner sized for, the replicas it wants (and what runs,
    where the stabilization window holds more), and why."""
    load = decision.predicted
    rates = (
        f"{load.rate_rps:.2f} req/s, in {load.input_tokens_mean:.0f} / out "
        f"{load.output_tokens_mean:.0f} tokens, hit P {load.p_hit:.2f} MD {load.md_hit:.2f}, "
        f"TTFT p90 {_fmt(load.ttft_p90_s, ' s')} (SLO {slo.ttft_p90_s:g} s), ITL p90 "
        f"{_fmt(load.itl_p90_s, ' s')} (SLO {slo.itl_p90_s:g} s), queue p90 P "
        f"{_fmt(load.prefill_queue_p90_s, ' s')} MD {_fmt(load.main_queue_p90_s, ' s')}"
    )
    desired = ", ".join(
        f"{role} {n}"
        + (f" (holding {applied[role]}: stabilization)" if applied.get(role, n) != n else "")
        + (f" (was {before[role]})" if before.get(role, n) != applied.get(role, n) else "")
        for role, n in decision.replicas.items()
    )
    return f"autoscale: {rates} -> {desired}; why: {why(decision, slo)}"


def why(decision: Decision, slo: Slo) -> str:
    """The planner's reasons: its sizing, the headroom a P90 miss added, the line. The
    misses are the observed interval's, the one the planner corrected its headroom on, and
    the pool blamed is the one it blamed there (the predicted load may queue elsewhere)."""
    load = decision.observed
    reasons = ["the step model's sizing for this load, within the bounds"]
    if load.ttft_p90_s > slo.ttft_p90_s:
        reasons.append(
            f"TTFT p90 over the SLO ({decision.blamed}'s queue)"
            if decision.blamed
            else "TTFT p90 over the SLO with no pool queued (the line, a handoff or the machine)"
        )
    if load.itl_p90_s > slo.itl_p90_s:
        reasons.append("ITL p90 over the SLO")
    grown = [f"{role} x{h:.2f}" for role, h in decision.headroom.items() if h != 1.0]
    if grown:
        reasons.append("headroom after P90 misses: " + ", ".join(grown))
    if decision.line_bound:
        reasons.append("the WAN line is the bottleneck: more replicas cannot meet the SLO")
    return "; ".join(reasons)


class Autoscaler:
    """Every ``interval_s`` (on the clock ``tick`` is given): scrape, decide, scale, log.
    Retired workers that exited are reported at every tick."""

    def __init__(
        self,
        scaler: Scaler,
        scrape: Scrape,
        decide: Decide,
        settings: AutoscaleSettings,
        say: Say,
        changed: Callable[[Mapping[str, int]], None] = lambda _counts: None,
    ) -> None:
        self.scaler, self.scrape, self.decide = scaler, scrape, decide
        self.settings, self.say, self.changed = settings, say, changed
        self._next_at: float | None = None
        self._stabilizers = {str(role): Stabilizer(settings.stabilize_s) for role in TIERS}

    def report_exits(self) -> None:
        """Say how each retired worker that exited since the last call ended."""
        for death in self.scaler.reap():
            self.say(f"autoscale: {drained_line(death)}")

    def tick(self, now: float) -> Decision | None:
        """Report drained workers; at the interval, one decision (None otherwise, and
        until two scrapes are an interval apart)."""
        self.report_exits()
        if self._next_at is not None and now < self._next_at:
            return None
        self._next_at = now + self.settings.interval_s
        try:
            decision = self.decide(self.scrape(), now)
        except LoadError as exc:  # counters that make no load (a clock step): skip a round
            self.say(f"autoscale: this round decides nothing: {exc}")
            return None
        if decision is None:
            return None
        before = self.scaler.counts()
        applied = {r: self._stabilizers[r](now, n) for r, n in decision.replicas.items()}
        done = [a for role in TIERS for a in self.scaler.scale(role, applied[role])]
        self.say(decision_line(decision, before, applied, self.settings.slo))
        if done:
            self.say(f"autoscale: {'; '.join(done)}")
            self.changed(self.scaler.counts())
        return decision


def drained_line(death: Death) -> str:
    """How a retired worker ended: drained (exit 0, nothing cut) or not."""
    child = death.child
    if DRAIN_CUT in child.log_tail(50):
        how = f"{DRAINS_CUT}: requests cut"
    else:
        how = "drained" if death.returncode == 0 else "not a clean drain: see its log"
    return f"{child.name} exited with code {death.returncode} ({how}); slot free"


def add_autoscale_flags(p: argparse.ArgumentParser) -> None:
    """``pdd up``'s ``--autoscale`` and what bounds and drives it."""
    p.add_argument(
        "--autoscale", action="store_true",
        help="the SLO planner sizes P, RLD and MD (--mode pdd) within the bounds below, "
        "every --autoscale-interval-s, from the router's and workers' metrics; --prefill, "
        "--relay, --main are then the replicas each tier starts with",
    )  # fmt: skip
    for role in TIERS:
        p.add_argument(f"--autoscale-min-{role}", type=int, default=1, metavar="N",
                       help=f"fewest {role} workers (default %(default)s)")  # fmt: skip
        p.add_argument(f"--autoscale-max-{role}", type=int, default=2, metavar="N",
                       help=f"most {role} workers (default %(default)s)")  # fmt: skip
    p.add_argument("--slo-ttft-p90-s", type=float, default=2.0, metavar="S",
                   help="TTFT target at P90, client side (default %(default)s)")  # fmt: skip
    p.add_argument("--slo-itl-p90-s", type=float, default=0.2, metavar="S",
                   help="inter-token latency target at P90 (default %(default)s)")  # fmt: skip
    p.add_argument("--autoscale-interval-s", type=float, default=10.0, metavar="S",
                   help="seconds between decisions (default %(default)s)")  # fmt: skip
    p.add_argument(
        "--autoscale-stabilize-s", type=float, default=300.0, metavar="S",
        help="scale down only to the most replicas decided over this window, as an HPA's "
        "scale-down stabilization (default %(default)s, HPA's)",
    )  # fmt: skip
    p.add_argument(
        "--autoscale-scenario", default="published",
        help="the simulator scenario (name or YAML file) whose step model the planner "
        "sizes with, as the operator's --planner-scenario (default %(default)s)",
    )  # fmt: skip


def settings_from_args(args: argparse.Namespace, mode: str) -> AutoscaleSettings:
    """The flags as settings for a stack of ``mode``; AutoscaleError names a flag that
    cannot be."""
    if mode != "pdd":
        raise AutoscaleError(f"--autoscale sizes P, RLD and MD: --mode pdd, not {mode}")
    try:
        bounds = {
            role: PoolBounds(
                str(role),
                1.0,
                getattr(args, f"autoscale_min_{role}"),
                getattr(args, f"autoscale_max_{role}"),
            )
            for role in TIERS
        }
        slo = Slo(args.slo_ttft_p90_s, args.slo_itl_p90_s)
    except LoadError as exc:
        raise AutoscaleError(f"--autoscale: {exc}") from None
    return AutoscaleSettings(
        bounds, slo, args.autoscale_interval_s, args.autoscale_scenario,
        args.autoscale_stabilize_s,
    )  # fmt: skip


def sized_config(config: StackConfig, settings: AutoscaleSettings) -> tuple[StackConfig, set[str]]:
    """``config`` rendered with every tier's maximum, and the slots left standby beyond
    each tier's first replicas (``--ROLE N`` within the bounds)."""
    asked = config.counts
    most = {role: settings.bounds[role].max_replicas for role in TIERS}
    counts = Counts(most[Role.PREFILL], most[Role.RELAY], most[Role.MAIN], asked.mono)
    first = {role: settings.initial(role, getattr(asked, str(role))) for role in TIERS}
    slots = mode_workers(config.mode, counts)
    taken: dict[Role, int] = {}
    standby = set()
    for slot in slots:
        taken[slot.role] = taken.get(slot.role, 0) + 1
        if taken[slot.role] > first.get(slot.role, 0):
            standby.add(slot.name)
    return dataclasses.replace(config, counts=counts), standby


def for_stack(stack: LocalStack, settings: AutoscaleSettings, say: Say) -> Autoscaler:
    """The planner driving ``stack``'s tiers; stack.json follows every change."""
    tiers = Tiers(stack.pods)
    link = stack.config.link
    planning = planner_round(settings, link.gbps, link.rtt_ms / 1000)

    def scrape_stack() -> dict[str, PodMetrics]:
        with httpx.Client(verify=False) as http:
            return scrape(http, tiers.targets(stack.info.router_url))

    stack.save_replicas(tiers.counts())
    return Autoscaler(tiers, scrape_stack, planning.step, settings, say, stack.save_replicas)
