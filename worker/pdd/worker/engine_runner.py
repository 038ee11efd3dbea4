"""The engine thread: the only thread that touches torch and the Engine.

The worker's asyncio side (HTTP control API, data-plane transport) must never
block on a forward pass, and the Engine is single-threaded by contract. So one
dedicated thread owns it and loops: run queued commands (closures over the
engine, submitted from the event loop), then one ``engine.step()`` if there is
work. Results travel back through futures; each step's outputs are delivered on
the event loop to the subscriber of each request. Because command results and
step outputs go through the same ``call_soon_threadsafe`` FIFO, the event loop
sees them in the order the engine thread produced them (a subscriber
registered before ``resume`` never misses the first output).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdd.worker.engine import Engine, EngineStats
from pdd.worker.request import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
Subscriber = Callable[[RequestOutput], None]

_IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class RunnerSnapshot:
    """Engine state as of the end of the last loop turn (read without the engine thread)."""

    stats: EngineStats
    steps: int


class EngineRunner:
    """Drives an Engine on its own thread; ``call``/``subscribe`` from the event loop only."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self._loop = loop
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], concurrent.futures.Future]]
        self._commands = queue.SimpleQueue()
        self._subscribers: dict[str, Subscriber] = {}
        self._step_waiters: list[asyncio.Future[None]] = []
        self._stop = threading.Event()
        self._steps = 0
        self.snapshot = self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its result or exception."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future, loop=self._loop)

    def subscribe(self, request_id: str, subscriber: Subscriber) -> None:
        """Deliver ``request_id``'s step outputs to ``subscriber`` (on the event loop)."""
        self._subscribers[request_id] = subscriber

    def unsubscribe(self, request_id: str) -> None:
        self._subscribers.pop(request_id, None)

    async def next_step(self) -> None:
        """Wait until the engine thread has finished one more loop turn (step or idle)."""
        waiter = self._loop.create_future()
        self._step_waiters.append(waiter)
        await waiter

    # --- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_commands(block=not self.engine.has_unfinished())
            outputs: list[RequestOutput] = []
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a bug in one step must not kill the engine thread
                    log.exception("engine step failed; failing the requests it held")
                    outputs = self.engine.fail_scheduled(f"engine step failed: {exc!r}")
                self._steps += 1
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

    def _take_snapshot(self) -> RunnerSnapshot:
        return RunnerSnapshot(
            stats=self.engine.stats,
            steps=self._steps,
        )

    # --- the event loop -------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            subscriber = self._subscribers.get(out.request_id)
            if subscriber is None:
                continue
            if out.finished:
                self._subscribers.pop(out.request_id, None)
            try:
                subscriber(out)
            except Exception:
                log.exception("token subscriber of %s failed", out.request_id)
        waiters, self._step_waiters = self._step_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
