"""A decode instance (MD, RLD, or the baseline's D) under continuous batching.

Every step produces one token for each running sequence and costs
``InstanceShape.decode_seconds(batch, context)``. Between two events (an admission,
a completion, a stop, an extend) the batch does not change, so the step time is
constant and progress is linear in time: one counter of "tokens each running
sequence has produced since the epoch" replaces per-token events, and a sequence
finishes when the counter reaches its target. That is what lets an hour of traffic
over dozens of instances run in seconds.

Admission is FIFO and bounded by ``max_batch`` and by KV memory (a sequence reserves
its context plus the tokens it will generate, so nothing is ever preempted). An
*extend* (MD recomputing the token IDs a relay hands over) is one step with extra
new tokens; its extra cost over a plain decode step pauses the whole batch, which is
the stall the technique's catch-up mode spreads into small pieces.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import simpy

from pdd.common.vocabulary import Role
from pdd.router.instance_choice import InstanceLoad
from pdd.simulator.events import Alarm
from pdd.simulator.hardware import InstanceShape
from pdd.simulator.prefix_cache import PrefixCache
from pdd.simulator.queue_waits import QueueWaits


@dataclass(eq=False)
class DecodeSeq:
    """One sequence on one decode instance."""

    context: int  # tokens it holds when admitted (prompt + tokens generated elsewhere)
    generate: int  # tokens this instance must produce
    extend: int  # relayed tokens to recompute on admission (0: none)
    started: simpy.Event
    done: simpy.Event
    admitted_at: float = math.nan
    start_counter: float = 0.0
    stopped: bool = False
    produced: int = 0
    finished_at: float = math.nan

    @property
    def reserved(self) -> int:
        return self.context + self.generate


@dataclass
class DecodeStats:
    tokens: float = 0.0  # tokens produced
    stall_s: float = 0.0  # time paused by extends
    queue_waits: QueueWaits = field(default_factory=QueueWaits)  # per sequence, at admission


class DecodeInstance:
    def __init__(
        self,
        env: simpy.Environment,
        instance_id: str,
        role: Role,
        shape: InstanceShape,
        max_batch: int,
        cache: PrefixCache | None,
        on_load: Callable[[InstanceLoad], None] = lambda load: None,
    ) -> None:
        if max_batch <= 0:
            raise ValueError(f"{instance_id}: max_batch must be positive, got {max_batch}")
        self.env, self.instance_id, self.role, self.shape = env, instance_id, role, shape
        self.max_batch = max_batch
        self.cache = cache
        self.stats = DecodeStats()
        self._waiting: deque[tuple[float, DecodeSeq]] = deque()
        self._running: set[DecodeSeq] = set()
        self._targets: list[tuple[float, int, DecodeSeq]] = []
        self._ids = itertools.count()
        self._counter = 0.0  # tokens each running sequence produced since the epoch
        self._context_base = 0.0  # sum(context - start_counter) over running sequences
        self._reserved = 0
        self._held = 0  # stopped but not yet released (a relay awaiting MD's ack)
        self._expected = 0  # dispatched by the router, not yet submitted (KV in flight)
        self._pending = 0  # of those, the ones still at P: the router's pending (not active)
        self._last = 0.0
        self._paused_until = 0.0
        self._alarm = Alarm(env, self._on_timer)
        self._load = InstanceLoad(instance_id, role, 0, max_batch)
        self._on_load = on_load

    # --- what the router sees ---------------------------------------------------------------
    @property
    def active(self) -> int:
        return len(self._running) + len(self._waiting) + self._held + self._expected

    def load(self) -> InstanceLoad:
        """What the router sees (what is still at P as pending, not active); rebuilt only
        when a count changed."""
        pending = self._pending
        active = self.active - pending
        if self._load.active != active or self._load.pending != pending:
            self._load = InstanceLoad(self.instance_id, self.role, active, self.max_batch, pending)
        return self._load

    def _publish(self) -> None:
        """Hand a changed load to ``on_load`` (the router's fleet), at the end of every
        step that can change it: routing then never reads every instance."""
        before = self._load
        if self.load() is not before:
            self._on_load(self._load)

    @property
    def utilization(self) -> float:
        return self.active / self.max_batch

    @property
    def paused_until(self) -> float:
        return self._paused_until

    def reserve(self, pending: bool = False) -> None:
        """Count a dispatched request as load before its KV arrives, as the router does;
        ``pending``: it waits at P first, so it counts as pending until :meth:`reached`
        (the router's ``Lease.main_reached``): in the choice, not the saturation."""
        self._expected += 1
        self._pending += pending
        self._publish()

    def reached(self) -> None:
        """A pending request is past P: it counts in full from now on."""
        self._pending -= 1
        self._publish()

    def unreserve(self) -> None:
        self._expected -= 1
        self._publish()

    # --- requests ---------------------------------------------------------------------------
    def submit(
        self, context: int, generate: int, extend: int = 0, reserved: bool = False
    ) -> DecodeSeq:
        """Queue a sequence; ``started`` fires on admission, ``done`` after ``generate``.
        ``reserved``: it was counted by :meth:`reserve`, and now counts as queued instead
        (one load change for the router's fleet, not two that cancel out)."""
        seq = DecodeSeq(context, max(0, generate), extend, self.env.event(), self.env.event())
        if reserved:
            self._expected -= 1
        self._waiting.append((self.env.now, seq))
        self._advance()
        self._admit()
        self._reschedule()
        self._publish()
        return seq

    def generated(self, seq: DecodeSeq) -> int:
        """Tokens ``seq`` has produced here so far."""
        if seq.stopped or math.isnan(seq.admitted_at):
            return seq.produced
        self._advance()
        return min(seq.generate, int(self._counter - seq.start_counter + 1e-9))

    def stop(self, seq: DecodeSeq, hold: bool) -> int:
        """Stop ``seq`` now (a handoff); returns tokens produced. ``hold`` keeps it counted
        as load until :meth:`release` (the relay waits for MD's acknowledgement)."""
        if math.isnan(seq.admitted_at):
            self._waiting = deque(w for w in self._waiting if w[1] is not seq)
        elif not seq.stopped:
            seq.produced = self.generated(seq)
            self._remove(seq)
        seq.stopped = True
        if hold:
            self._held += 1
        self._admit()
        self._reschedule()
        self._publish()
        return seq.produced

    def release(self) -> None:
        self._held -= 1
        self._publish()

    def extend(self, tokens: int, context: int) -> simpy.Event:
        """Recompute ``tokens`` relayed IDs after ``context`` (a catch-up chunk) in the
        running batch; the event fires when the pause it costs is over."""
        self._advance()
        self._pause(tokens, context)
        self._reschedule()
        return self.env.timeout(self._paused_until - self.env.now)

    # --- the batch --------------------------------------------------------------------------
    def _admit(self) -> None:
        capacity = self.shape.kv_capacity_tokens
        while self._waiting and len(self._running) < self.max_batch:
            queued_at, seq = self._waiting[0]
            if self._running and self._reserved + seq.reserved > capacity:
                break  # FIFO: the head waits for memory (a lone sequence always fits)
            self._waiting.popleft()
            seq.admitted_at = self.env.now
            self.stats.queue_waits.record(self.env.now, self.env.now - queued_at)
            if seq.extend:
                self._pause(seq.extend, seq.context)
            seq.started.succeed()
            if seq.generate == 0:
                seq.stopped = True
                seq.finished_at = self.env.now
                seq.done.succeed()
                continue
            seq.start_counter = self._counter
            self._running.add(seq)
            self._reserved += seq.reserved
            self._context_base += seq.context - self._counter
            heapq.heappush(self._targets, (self._counter + seq.generate, next(self._ids), seq))

    def _remove(self, seq: DecodeSeq) -> None:
        self._running.discard(seq)
        self._reserved -= seq.reserved
        self._context_base -= seq.context - seq.start_counter

    def _pause(self, tokens: int, context: int) -> None:
        b = max(1, len(self._running))
        k = self._context_tokens()
        plain = self.shape.decode_seconds(b, k)
        pairs = k + tokens * context + tokens * tokens / 2
        extra = max(0.0, self.shape.step_seconds(b + tokens, k + context, pairs) - plain)
        self._paused_until = max(self.env.now, self._paused_until) + extra
        self.stats.stall_s += extra

    def _context_tokens(self) -> float:
        return self._context_base + len(self._running) * self._counter

    def _step_seconds(self) -> float:
        return self.shape.decode_seconds(len(self._running), self._context_tokens())

    def _advance(self) -> None:
        now = self.env.now
        n = len(self._running)
        if n:
            productive = now - max(self._last, self._paused_until)
            if productive > 0:
                steps = productive / self._step_seconds()
                self._counter += steps
                self.stats.tokens += steps * n
        self._last = now

    def _reschedule(self) -> None:
        while self._targets and self._targets[0][2].stopped:
            heapq.heappop(self._targets)
        if not self._targets:
            self._alarm.clear()
            return
        start = max(self.env.now, self._paused_until)
        left = max(0.0, self._targets[0][0] - self._counter) * self._step_seconds()
        self._alarm.set(start - self.env.now + left)

    def _on_timer(self) -> None:
        self._advance()
        while self._targets and self._targets[0][0] <= self._counter + 1e-6:
            _, _, seq = heapq.heappop(self._targets)
            if seq.stopped:
                continue
            seq.produced = seq.generate
            seq.stopped = True
            seq.finished_at = self.env.now
            self._remove(seq)
            seq.done.succeed()
        self._admit()
        self._reschedule()
        self._publish()
