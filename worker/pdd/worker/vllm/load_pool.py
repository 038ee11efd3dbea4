"""The PDD connector's KV loads, off vLLM's step: a few threads, and what each load left.

vLLM parks a request whose KV loads asynchronously (``WAITING_FOR_REMOTE_KVS``) and
keeps stepping the others; the connector's worker side starts each load here
(``start_load_kv``) and reports the finished ones at the end of a later step
(``get_finished``). A load is the store's file reads, the codec's decode and the scatter
into vLLM's blocks: torch and file I/O release the GIL, so a small pool overlaps them
with the forward of the requests already running.

A load whose request finished meanwhile (aborted) is cancelled: its ``cancelled`` event
is set, and the load stops before its next chunk. It is still reported finished, since
vLLM holds such a request's blocks until its load reports, so that a load never writes
into blocks handed to another request.

No vLLM import: the connector hands in the loads, the tests their stand-ins.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

#: A load: imports one request's KV, stops early once ``cancelled`` is set, and returns
#: the block IDs it left without KV (empty when it completed or was cancelled).
Load = Callable[[threading.Event], set[int]]


@dataclass(frozen=True)
class Finished:
    """What the loads that ended since the last ``collect`` report to vLLM."""

    request_ids: set[str]
    failed_blocks: set[int]


class LoadPool:
    """Runs each request's load on one of ``threads`` threads; ``collect`` takes the ended.

    Called from one thread (vLLM's worker); the loads run on the pool's.
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"the PDD connector needs at least one load thread, got {threads}")
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pdd-kv-load")
        self._loads: dict[str, tuple[Future[set[int]], threading.Event]] = {}

    def submit(self, request_id: str, load: Load) -> None:
        """Start ``request_id``'s load (one at a time per request, as vLLM parks it)."""
        if request_id in self._loads:
            raise RuntimeError(f"request {request_id} already has a KV load running")
        cancelled = threading.Event()
        self._loads[request_id] = (self._pool.submit(load, cancelled), cancelled)

    def cancel(self, request_ids: Iterable[str]) -> None:
        """Stop the loads of finished requests (most finished requests have none)."""
        for request_id in request_ids:
            running = self._loads.get(request_id)
            if running is not None:
                running[1].set()

    def collect(self) -> Finished:
        """The loads that ended, taken off the pool; a load's exception is raised here,
        in vLLM's step, as a synchronous load's would be."""
        ended = [rid for rid, (future, _) in self._loads.items() if future.done()]
        failed: set[int] = set()
        for request_id in ended:
            future, _ = self._loads.pop(request_id)
            failed |= future.result()
        return Finished(set(ended), failed)

    def shutdown(self) -> None:
        """Cancel every load and wait for the threads."""
        self.cancel(list(self._loads))
        self._pool.shutdown(wait=True)
        self._loads.clear()
