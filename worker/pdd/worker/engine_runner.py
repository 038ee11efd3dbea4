"""The engine's drivers: the engine thread (serving) and a loop-stepped one (deterministic runs).

The worker's asyncio side (HTTP control API, data-plane transport) must never
block on a forward pass, and the Engine is single-threaded by contract. So one
dedicated thread owns it and loops: run queued commands (closures over the
engine, submitted from the event loop), then one ``engine.step()`` if there is
work. Results travel back through futures; each step's outputs are delivered on
the event loop to the subscriber of each request. Because command results and
step outputs go through the same ``call_soon_threadsafe`` FIFO, the event loop
sees them in the order the engine thread produced them (a subscriber
registered before ``resume`` never misses the first output).

``LoopEngineRunner`` has the same interface (``EngineRunner``) but steps the engine on the event
loop itself, charging each step a fixed time: with a virtual clock, a run of
the whole data plane in one process has the same schedule on every machine.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdd.common.wire import REQUEST_FAILED_ERROR_TYPE
from pdd.worker.engine import Engine, EngineStats
from pdd.worker.engine.request import FinishReason, RequestOutput, UnknownRequestError

log = logging.getLogger(__name__)
T = TypeVar("T")
Subscriber = Callable[[RequestOutput], None]

_IDLE_WAIT_S = 0.05
_JOIN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RunnerSnapshot:
    """Engine state as of the end of the last loop turn (read without the engine thread)."""

    stats: EngineStats
    steps: int


class EngineRunner(abc.ABC):
    """How the worker's asyncio side drives its Engine: ``call``, ``subscribe``, ``next_step``.

    Two drivers: ``ThreadEngineRunner`` (serving) and ``LoopEngineRunner`` (deterministic
    runs). What they share lives here: subscribers, step waiters and the snapshot, all
    touched on the event loop only.
    """

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self._loop = loop
        self._subscribers: dict[str, Subscriber] = {}
        self._step_waiters: list[asyncio.Future[None]] = []
        self._aborts: set[asyncio.Task] = set()  # of requests whose subscriber failed
        self._steps = 0
        self.snapshot = self._take_snapshot()

    def subscribe(self, request_id: str, subscriber: Subscriber) -> None:
        """Deliver ``request_id``'s step outputs to ``subscriber`` (on the event loop)."""
        self._subscribers[request_id] = subscriber

    def unsubscribe(self, request_id: str) -> None:
        self._subscribers.pop(request_id, None)

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the engine is being driven: false once its driver died (the liveness
        probe's answer, so kubelet restarts a worker that can no longer step)."""

    @abc.abstractmethod
    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` between steps; its result or exception."""

    @abc.abstractmethod
    def after_next_step(self, fn: Callable[[Engine], T]) -> asyncio.Future[T]:
        """Run ``fn(engine)`` as soon as the engine's next loop turn (a step, or an idle
        turn) ends, before any later step starts; its result or exception, as a future
        (registered before this returns). What that
        step wrote is read at once: a ``call`` made when the step's outputs reach the
        event loop would wait behind the step the engine has started meanwhile (a
        streamed prefill's KV would then lag its prefill by a whole chunk)."""

    async def next_step(self) -> None:
        """Wait until the engine has finished one more loop turn (step or idle)."""
        waiter = self._loop.create_future()
        self._step_waiters.append(waiter)
        await waiter

    def _step_once(self) -> list[RequestOutput]:
        """One ``engine.step()``; a failing step fails the requests it held, not the runner."""
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug in one step must not kill the engine's driver
            log.exception("engine step failed; failing the requests it held")
            outputs = self.engine.fail_scheduled(f"engine step failed: {exc!r}")
        self._steps += 1
        return outputs

    def _subscriber_failed(
        self, out: RequestOutput, subscriber: Subscriber, exc: Exception
    ) -> None:
        """A subscriber raised on ``out`` (the role's work on one request's output): that
        request alone ends. The engine lets go of it, and the subscriber is told once more,
        with an error output, so the request's stream ends with the error instead of
        hanging; the other requests of the step were delivered as ever."""
        rid = out.request_id
        log.exception("token subscriber of %s failed; ending that request", rid)
        self._subscribers.pop(rid, None)
        if not out.finished:
            task = self._loop.create_task(self.call(functools.partial(_abort_quietly, rid=rid)))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
        error = RequestOutput(
            rid, [], True, FinishReason.ABORT, error=f"the worker failed on its output: {exc!r}",
            error_type=REQUEST_FAILED_ERROR_TYPE,
        )  # fmt: skip
        try:
            subscriber(error)
        except Exception:
            log.exception("token subscriber of %s failed on its error too", rid)

    def _take_snapshot(self) -> RunnerSnapshot:
        return RunnerSnapshot(stats=self.engine.stats, steps=self._steps)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            subscriber = self._subscribers.get(out.request_id)
            if subscriber is None:
                continue
            if out.finished:
                self._subscribers.pop(out.request_id, None)
            try:
                subscriber(out)
            except Exception as exc:
                self._subscriber_failed(out, subscriber, exc)
        waiters, self._step_waiters = self._step_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class ThreadEngineRunner(EngineRunner):
    """Drives an Engine on its own thread; ``call``/``subscribe`` from the event loop only."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(engine, loop)
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], concurrent.futures.Future]]
        self._commands = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        #: ``after_next_step`` work: appended on the event loop, taken on the engine thread.
        self._after_step: list[tuple[Callable[[Engine], Any], concurrent.futures.Future]] = []
        self._after_step_lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(_JOIN_TIMEOUT_S)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its result or exception."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future, loop=self._loop)

    def after_next_step(self, fn: Callable[[Engine], T]) -> asyncio.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._after_step_lock:
            self._after_step.append((fn, future))
        self._commands.put((_turn, concurrent.futures.Future()))  # an idle engine turns at once
        return asyncio.wrap_future(future, loop=self._loop)

    # --- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_commands(block=not self.engine.has_unfinished())
            outputs = self._step_once() if self.engine.has_unfinished() else []
            with self._after_step_lock:
                after, self._after_step = self._after_step, []
            _run_all(self.engine, after)
            self.snapshot = self._take_snapshot()
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _run_commands(self, block: bool) -> None:
        try:
            item = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:
                    future.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return


def _abort_quietly(engine: Engine, rid: str) -> None:
    """Abort ``rid`` if the engine still holds it."""
    with contextlib.suppress(UnknownRequestError):
        engine.abort(rid)


def _turn(engine: Engine) -> None:
    """A command that does nothing: it wakes an idle engine thread for one loop turn."""


def _run_all(engine: Engine, work: list[tuple[Callable[[Engine], Any], Any]]) -> None:
    """Run each ``fn(engine)`` into its future (concurrent or asyncio), skipping those
    cancelled meanwhile."""
    for fn, future in work:
        if isinstance(future, concurrent.futures.Future):
            if not future.set_running_or_notify_cancel():
                continue
        elif future.done():
            continue
        try:
            future.set_result(fn(engine))
        except Exception as exc:
            future.set_exception(exc)


class LoopEngineRunner(EngineRunner):
    """Drives an Engine on the event loop itself, each step taking ``step_s`` of loop time.

    Same interface as ``ThreadEngineRunner``. A step blocks the loop while it computes,
    so this is not for serving; it is for runs whose schedule must not depend on
    the machine: under a virtual clock (``pdd.testing.virtual_time``) every step
    costs exactly ``step_s``, so how far a relay decodes while KV crosses a link
    is a property of the scenario, not of the CPU.
    """

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, step_s: float) -> None:
        super().__init__(engine, loop)
        if step_s <= 0:
            raise ValueError(f"step_s must be positive, got {step_s}")
        self.step_s = step_s
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._after_step: list[tuple[Callable[[Engine], Any], asyncio.Future]] = []

    def start(self) -> None:
        self._task = self._loop.create_task(self._run(), name="engine-steps")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` now (whenever a coroutine runs, the loop is between steps)."""
        try:
            return fn(self.engine)
        finally:
            self.snapshot = self._take_snapshot()
            self._work.set()

    async def next_step(self) -> None:
        self._work.set()  # an idle engine still turns once, as the thread does
        await super().next_step()

    def after_next_step(self, fn: Callable[[Engine], T]) -> asyncio.Future[T]:
        future: asyncio.Future[T] = self._loop.create_future()
        self._after_step.append((fn, future))
        self._work.set()  # an idle engine still turns once, as the thread does
        return future

    async def _run(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            outputs: list[RequestOutput] = []
            if self.engine.has_unfinished():
                outputs = self._step_once()
                await asyncio.sleep(self.step_s)  # the step's duration, in loop time
                self._work.set()  # keep stepping while there is work
            after, self._after_step = self._after_step, []
            _run_all(self.engine, after)
            self.snapshot = self._take_snapshot()
            self._deliver(outputs)
