"""After a replay: does any worker still hold something? (``/v1/pdd/debug/state``)

Once every client request has ended, a worker must hold no request state, no prefix lock
and no KV block beyond its prefix cache (``StateReport.quiescent``). Some letting go takes
its time (P keeps a prompt's KV until its transfer to MD has ended or timed out), so the
workers are polled until all are quiescent or ``timeout_s`` has passed; what each still
holds then is what leaked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import httpx

from pdd.common.wire import StateReport

#: How long workers get to let go after the last request ended: P's transfer timeout
#: (30 s by default) and a margin for a loaded machine.
SETTLE_TIMEOUT_S = 120.0
#: What ``leaks`` counts per worker (all 0 on a quiescent one).
HELD = ("leaked_blocks", "locked_blocks", "live_requests", "engine_requests")


async def settle(
    workers: Mapping[str, str], secret: str, timeout_s: float = SETTLE_TIMEOUT_S
) -> dict[str, StateReport]:
    """Each worker's state (name -> report) once all are quiescent, or at ``timeout_s``.
    A worker that does not answer is left out (it is not a survivor)."""
    headers = {"Authorization": f"Bearer {secret}"}
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10.0, headers=headers) as client:
        while True:
            states = await _states(client, workers)
            if all(s.quiescent for s in states.values()) or time.monotonic() > deadline:
                return states
            await asyncio.sleep(0.2)


async def _states(client: httpx.AsyncClient, workers: Mapping[str, str]) -> dict[str, StateReport]:
    names = list(workers)
    answers = await asyncio.gather(
        *(client.get(f"{workers[n]}/v1/pdd/debug/state") for n in names), return_exceptions=True
    )
    states = {}
    for name, answer in zip(names, answers, strict=True):
        if isinstance(answer, httpx.Response) and answer.status_code == 200:
            states[name] = StateReport.model_validate_json(answer.content)
        elif not isinstance(answer, httpx.HTTPError | httpx.Response):
            raise answer
    return states


def leaks(states: Mapping[str, StateReport]) -> dict[str, Any]:
    """What the workers still hold, summed, and per worker that holds anything."""

    def held(s: StateReport) -> dict[str, int]:
        leaked = s.kv_blocks_total - s.kv_blocks_free - s.kv_blocks_cached
        counts = (leaked, s.kv_blocks_locked, s.live_requests, s.engine_requests)
        return dict(zip(HELD, counts, strict=True))

    per_worker = {name: held(s) for name, s in sorted(states.items())}
    summed = {k: sum(h[k] for h in per_worker.values()) for k in HELD}
    return {
        **summed,
        "workers_checked": len(states),
        "holding": {n: h for n, h in per_worker.items() if any(h.values())},
    }
