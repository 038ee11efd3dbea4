"""A vLLM start that SIGTERM can stop: the worker's processes go with it.

``AsyncLLM`` launches its engine core (and that, its model workers) as processes of its
own, then waits for them in a zmq poll that no Python signal handler interrupts (pyzmq
retries it), for as long as the model takes to load. A worker stopped meanwhile (a pod
deleted, ``pdd up`` giving up on readiness) would exit on Python's default SIGTERM and
leave those processes running, holding gigabytes. So vLLM starts on a thread while the
event loop keeps the main thread, where SIGTERM kills every process this one started
and exits; once vLLM is up, SIGTERM is the worker's again (the drain). What the start
made on the host (the ipc socket vLLM's engine core binds for its KV events, named by the
worker's PID) goes too, on that stop and on a failed start: the worker's own stop, which
removes it otherwise, never runs then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from pdd.worker.vllm.engine_args import VllmEngineSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


async def start_stoppably(start: Callable[[], T], leftovers: Sequence[Path] = ()) -> T:
    """``start()`` on a thread; a SIGTERM meanwhile kills this process's descendants,
    removes the files ``leftovers`` names and exits (status 143). A start that fails
    removes them too."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, _stop_everything, leftovers)
    try:
        return await asyncio.to_thread(start)
    except BaseException:
        remove(leftovers)
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _stop_everything(leftovers: Sequence[Path]) -> None:
    pids = descendants(os.getpid())
    log.warning("SIGTERM while vLLM starts: stopping its %d processes and exiting", len(pids))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    remove(leftovers)
    os._exit(128 + signal.SIGTERM)


def host_files(settings: VllmEngineSettings) -> list[Path]:
    """The files a vLLM start makes on the host: the ipc socket of its KV events."""
    endpoint = settings.kv_events_endpoint
    if endpoint is None or not endpoint.startswith("ipc://"):
        return []
    return [Path(endpoint.removeprefix("ipc://"))]


def remove(files: Sequence[Path]) -> None:
    for path in files:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first), from /proc."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *descendants(int(child))]
    return found
