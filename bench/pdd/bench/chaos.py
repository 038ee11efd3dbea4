"""Chaos during a replay (``pdd bench --chaos``): seeded kills, restarts and WAN cuts.

What a bad day does to a deployment, done to the local stack while a trace replays: a
worker (P, RLD or MD) is SIGKILLed and, some requests later, started again with the same
name and flags, as a Deployment recreates a pod whose container died; the WAN line is
cut (both directions) and, some requests later, restored.

The schedule is drawn from the seed alone, with the mode's workers and the number of
requests: each event's kind, target, the count of finished requests it waits for, and
how many more it lasts. Events run one after another: each starts once its count is
reached and the previous one is over (a restarted worker answers its readiness probe and
the router counts every worker of its role ready again), so no wall clock decides when
anything happens; only a restart's own start-up takes what it takes. Running one at a
time keeps a survivor of every role that has two instances or more.

Where P or MD has one instance, killing it leaves nothing to serve that part of a
request (a lone relay's death does not: P-MD serves without one), and a cut leaves
nothing to carry a request across the WAN in a mode without a relay: these spans are
``outages``, and a request that fails while one lasts is counted
apart (nothing could have served it). Every other request must complete with the
reference mode's tokens.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from pdd.bench.scale_down import Worker
from pdd.common.vocabulary import Role
from pdd.local.probes import flatten, total
from pdd.local.supervisor import Child

EventKind = Literal["kill", "cut"]
#: The target of a cut: every WAN line of the stack (both directions).
WAN = "wan"
#: Roles whose workers a chaos run kills (mono is the reference, never touched).
KILLABLE_ROLES = (Role.PREFILL, Role.RELAY, Role.MAIN)


class ChaosError(ValueError):
    """A ``--chaos`` the bench cannot run; the message says what to pass."""


@dataclass(frozen=True)
class ChaosEvent:
    """One planned event: ``kill`` a worker or ``cut`` the WAN once ``after`` requests
    have finished, undone (restart, restore) ``lasts`` finished requests later."""

    kind: EventKind
    target: str  # a worker's name, or WAN
    role: str  # the worker's role, or WAN
    after: int
    lasts: int

    def describe(self) -> str:
        what = f"kill {self.target} ({self.role})" if self.kind == "kill" else "cut the WAN"
        undo = "restart it" if self.kind == "kill" else "restore it"
        return f"{what} after {self.after} requests, {undo} {self.lasts} requests later"


def plan(
    seed: int, events: int, workers: Sequence[Worker], wan: bool, requests: int
) -> list[ChaosEvent]:
    """The schedule for one mode: the same arguments always give the same events.

    Both kinds come up at least once when the mode has both and ``events`` >= 2 (a kill
    needs a P, RLD or MD; a cut needs a WAN line); start counts are spread over the
    first 70% of the requests, so the replay still runs when the last one is undone."""
    rng = random.Random(seed)
    killable = sorted((w for w in workers if w.role in KILLABLE_ROLES), key=lambda w: w.name)
    can: dict[EventKind, bool] = {"kill": bool(killable), "cut": wan}
    kinds = [kind for kind, possible in can.items() if possible]
    if not kinds or events < 1 or requests < 2:
        return []
    rng.shuffle(kinds)
    drawn = [*kinds, *(rng.choice(kinds) for _ in range(max(0, events - len(kinds))))][:events]
    low = max(1, requests // 10)
    high = max(low, requests * 7 // 10)
    starts = sorted(rng.randint(low, high) for _ in drawn)
    longest = max(1, (high - low) // (2 * len(drawn)))
    schedule = []
    for kind, after in zip(drawn, starts, strict=True):
        victim = rng.choice(killable) if kind == "kill" else None
        schedule.append(
            ChaosEvent(
                kind=kind,
                target=victim.name if victim else WAN,
                role=str(victim.role) if victim else WAN,
                after=after,
                lasts=rng.randint(1, longest),
            )
        )
    return schedule


@dataclass
class Ran:
    """An event as it ran; times in seconds since the replay began."""

    kind: EventKind
    target: str
    role: str
    started_after: int  # requests finished when it started
    started_s: float
    undone_after: int | None = None  # ... when the worker was restarted or the line restored
    undone_s: float | None = None
    ready_s: float | None = None  # a restarted worker ready, and the router counting it
    outage: bool = False  # nothing could serve what it broke (see the module's docstring)
    problem: str | None = None

    @property
    def over_s(self) -> float | None:
        """When the event stopped mattering: the worker back, or the line restored."""
        return self.ready_s if self.kind == "kill" else self.undone_s

    def describe(self) -> str:
        head = f"{self.kind} {self.target} after {self.started_after} requests"
        head += f" ({self.started_s:.1f} s)"
        undo = "restarted" if self.kind == "kill" else "restored"
        if self.undone_s is not None:
            head += f", {undo} after {self.undone_after} ({self.undone_s:.1f} s)"
        if self.ready_s is not None:
            head += f", ready again at {self.ready_s:.1f} s"
        if self.outage:
            head += "; no survivor meanwhile"
        return head + (f"; {self.problem}" if self.problem else "")


@dataclass
class ChaosTarget:
    """The parts of a running stack a chaos run acts on and watches."""

    router_url: str
    children: dict[str, Child]  # worker name -> its process
    ready_urls: dict[str, str]  # worker name -> its readiness probe
    roles: dict[str, str]  # worker name -> role
    link_admin_urls: tuple[str, ...]
    relay: bool  # the mode has a relay (RLD carries a request the WAN cannot)
    ready_timeout_s: float = 180.0


@dataclass
class Chaos:
    """Runs a schedule beside a replay: ``on_outcome`` counts finished requests,
    ``run`` acts when the counts are reached, ``replay_over`` ends what is still on."""

    schedule: Sequence[ChaosEvent]
    target: ChaosTarget
    ran: list[Ran] = field(default_factory=list)
    _finished: int = 0
    _now: Callable[[], float] = time.monotonic
    _progress: asyncio.Event = field(default_factory=asyncio.Event)
    _over: bool = False

    def on_outcome(self) -> None:
        self._finished += 1
        self._progress.set()

    def replay_over(self) -> None:
        self._over = True
        self._progress.set()

    @property
    def outages(self) -> list[tuple[float, float]]:
        """Spans (s since the replay began) in which nothing could serve what an event broke."""
        return [(r.started_s, r.over_s or r.started_s) for r in self.ran if r.outage]

    async def run(self, since_start: Callable[[], float]) -> None:
        """Every event in order; the one the replay's end interrupts is still undone (so
        the workers are all back for the leak check), later ones are not run.
        ``since_start``: seconds since the replay began (its requests' clock)."""
        self._now = since_start
        # verify=False: a readiness probe of MD's https port checks no certificate, as
        # kubelet's does (the router is what verifies it: pdd.common.wan_tls).
        async with httpx.AsyncClient(timeout=10.0, verify=False) as client:
            for event in self.schedule:
                await self._reach(event.after)
                if self._over:
                    return
                ran = await self._start(client, event)
                self.ran.append(ran)
                await self._reach(ran.started_after + event.lasts)
                await self._undo(client, ran)

    async def _reach(self, finished: int) -> None:
        while self._finished < finished and not self._over:
            self._progress.clear()
            await self._progress.wait()

    async def _start(self, client: httpx.AsyncClient, event: ChaosEvent) -> Ran:
        t, problem = self.target, None
        at = (self._finished, self._now())  # before acting: a request it fails ends after
        if event.kind == "kill":
            others = sum(r == event.role for r in t.roles.values()) - 1
            alone = others == 0 and event.role != Role.RELAY
            child = t.children[event.target]
            child.proc.kill()
            await asyncio.to_thread(child.proc.wait)
        else:
            alone = not t.relay
            problem = await self._partition(client, cut=True)
        return Ran(event.kind, event.target, event.role, *at, outage=alone, problem=problem)

    async def _undo(self, client: httpx.AsyncClient, ran: Ran) -> None:
        ran.undone_after, ran.undone_s = self._finished, self._now()
        if ran.kind == "cut":
            ran.problem = await self._partition(client, cut=False) or ran.problem
            return
        self.target.children[ran.target].restart()
        try:
            await self._back(client, ran)
            ran.ready_s = self._now()
        except TimeoutError as exc:
            ran.problem = str(exc)

    async def _partition(self, client: httpx.AsyncClient, cut: bool) -> str | None:
        """Cut or restore every line; what went wrong, if a line's admin API refused."""
        for url in self.target.link_admin_urls:
            try:
                (await client.post(f"{url}/partition", json={"cut": cut})).raise_for_status()
            except httpx.HTTPError as exc:
                return f"{'cutting' if cut else 'restoring'} {url} failed: {exc!r}"
        return None

    async def _back(self, client: httpx.AsyncClient, ran: Ran) -> None:
        """Until the restarted worker is ready and the router counts every worker of its
        role ready (the router polls its workers; it must see this one come back)."""
        t = self.target
        want = sum(r == ran.role for r in t.roles.values())
        deadline = time.monotonic() + t.ready_timeout_s
        ready_url = t.ready_urls[ran.target]
        while not (
            await _answers(client, ready_url)
            and await _router_counts(client, t.router_url, ran.role) == want
        ):
            if t.children[ran.target].proc.poll() is not None:
                raise TimeoutError(f"{ran.target} exited again after its restart")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{ran.target} not back in {t.ready_timeout_s:.0f} s")
            await asyncio.sleep(0.2)

    def document(self, seed: int) -> dict[str, Any]:
        """For results.json: the seed, the planned events and what ran."""
        return {
            "seed": seed,
            "planned": [asdict(e) for e in self.schedule],
            "ran": [asdict(r) for r in self.ran],
            "not_run": len(self.schedule) - len(self.ran),
        }


async def _answers(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(url)).status_code == 200
    except httpx.HTTPError:
        return False


async def _router_counts(client: httpx.AsyncClient, router_url: str, role: str) -> int:
    """How many workers of ``role`` the router holds ready now."""
    try:
        text = (await client.get(f"{router_url}/metrics")).text
    except httpx.HTTPError:
        return -1
    return int(total(flatten(text), "pdd_router_instances_ready", role=role))
