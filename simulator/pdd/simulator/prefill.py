"""A prefill instance (P) with chunked prefill: one step per chunk of queued work.

Each step takes up to ``max_num_batched_tokens`` uncached tokens from the FIFO queue (the tail
of one request and the head of the next share a step, as continuous batching does)
and costs ``InstanceShape.step_seconds`` for those tokens, their cached context and
their attention pairs. A small tail chunk alone in a step pays the whole weight read
for little compute: the "tail chunk" dip of the technique's bathtub.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import simpy

from pdd.common.vocabulary import Role
from pdd.router.instance_choice import InstanceLoad
from pdd.simulator.hardware import InstanceShape
from pdd.simulator.prefix_cache import PrefixCache
from pdd.simulator.queue_waits import QueueWaits


@dataclass(eq=False)
class PrefillJob:
    new_tokens: int  # P's miss
    cached_tokens: int  # P's hit
    done: simpy.Event
    #: Fires when the first step that computes any of it ends: its first chunk's KV is
    #: written, and P starts streaming KV from there.
    written: simpy.Event
    processed: int = 0
    queued_at: float = 0.0


@dataclass
class PrefillStats:
    tokens: int = 0
    busy_s: float = 0.0
    steps: int = 0
    queue_waits: QueueWaits = field(default_factory=QueueWaits)  # per job, at its first chunk


class PrefillInstance:
    def __init__(
        self,
        env: simpy.Environment,
        instance_id: str,
        shape: InstanceShape,
        max_num_batched_tokens: int,
        max_queue: int,
        cache: PrefixCache | None,
        on_load: Callable[[InstanceLoad], None] = lambda load: None,
    ) -> None:
        if max_num_batched_tokens <= 0 or max_queue <= 0:
            raise ValueError(
                f"{instance_id}: max_num_batched_tokens and max_queue must be positive"
            )
        self.env, self.instance_id, self.shape = env, instance_id, shape
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_queue = max_queue
        self.cache = cache
        self.stats = PrefillStats()
        self._queue: deque[PrefillJob] = deque()
        self._stepping = False  # a step (or the wake-up that starts one) is scheduled
        self._load = InstanceLoad(instance_id, Role.PREFILL, 0, max_queue)
        self._on_load = on_load

    @property
    def active(self) -> int:
        return len(self._queue)

    def load(self) -> InstanceLoad:
        """What the router sees; rebuilt only when the queue length changed."""
        queued = len(self._queue)
        if self._load.active != queued:
            self._load = InstanceLoad(self.instance_id, Role.PREFILL, queued, self.max_queue)
        return self._load

    def _publish(self) -> None:
        """Hand a changed load to ``on_load`` (the router's fleet) when the queue moved."""
        before = self._load
        if self.load() is not before:
            self._on_load(self._load)

    def submit(self, new_tokens: int, cached_tokens: int) -> simpy.Event:
        """Queue a prefill; the event fires when its last chunk is computed."""
        return self.enqueue(new_tokens, cached_tokens).done

    def enqueue(self, new_tokens: int, cached_tokens: int) -> PrefillJob:
        """Queue a prefill; its ``written`` fires when its first chunk is computed, ``done``
        when its last is. A full hit still computes one token: the first output token
        needs the last position's logits."""
        done, written = self.env.event(), self.env.event()
        job = PrefillJob(max(1, new_tokens), cached_tokens, done, written, 0, self.env.now)
        self._queue.append(job)
        self._publish()
        if not self._stepping:
            # Wake at this instant, not now: requests submitted at the same instant
            # before the wake-up fires join the first step.
            self._stepping = True
            self.env.timeout(0).callbacks.append(self._start_step)
        return job

    # The step loop runs on event callbacks, not in a simpy process: a step costs one
    # timeout, without a generator to resume.
    def _start_step(self, _: object = None) -> None:
        if not self._queue:
            self._stepping = False
            return
        started = self.env.now
        batch = self._take_chunk()
        step = self.env.timeout(self._step_seconds(batch))
        step.callbacks.append(lambda _: self._end_step(started, batch))

    def _end_step(self, started: float, batch: list[tuple[PrefillJob, int]]) -> None:
        self.stats.busy_s += self.env.now - started
        self.stats.steps += 1
        for job, n in batch:
            job.processed += n
            self.stats.tokens += n
            if not job.written.triggered:
                job.written.succeed()
            if job.processed >= job.new_tokens:
                self._queue.remove(job)
                job.done.succeed()
        self._publish()
        self._start_step()

    def _take_chunk(self) -> list[tuple[PrefillJob, int]]:
        """Jobs and token counts for the next step, FIFO, up to ``max_num_batched_tokens``."""
        budget, batch = self.max_num_batched_tokens, []
        for job in self._queue:
            if budget <= 0:
                break
            if job.processed == 0:
                self.stats.queue_waits.record(self.env.now, self.env.now - job.queued_at)
            n = min(job.new_tokens - job.processed, budget)
            batch.append((job, n))
            budget -= n
        return batch

    def _step_seconds(self, batch: list[tuple[PrefillJob, int]]) -> float:
        new = read = pairs = 0.0
        for job, n in batch:
            context = job.cached_tokens + job.processed
            new += n
            read += context + n
            pairs += n * context + n * n / 2
        return self.shape.step_seconds(new, read, pairs)
