"""Clients that vanish at random points of their streams leave nothing held on any worker.

A client may go away at any moment of a request's life: before the router has the
plan on P, while P prefills or ships the KV, while the relay streams, after MD took
over. Wherever it happens, the router's cancel must reach every instance the request
touched, or find it refused when it arrives there later, so no request, lock or KV
block outlives its client on P, RLD or MD. Nor does the router keep anything of it: once
idle, each router holds the file descriptors it held idle before the churn (its
listening socket, its logs, one pooled connection per worker it polls); a connection
whose close was cut short stays open for good and would keep the count above that.
"""

import asyncio
import os
import random

import httpx
import pytest

from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration

STREAMS = 200
CONCURRENT = 8
MAX_TOKENS = 160
#: Where each client leaves: before the response headers, right after them, after a
#: few token frames, or never (it reads to the end).
KILL_POINTS = ("in_flight", "headers", "tokens", "tokens", "tokens", "tokens", "end")


@pytest.fixture(scope="module")
def routers(worker_flags, start_router):
    """One router that routes P-MD (the line fits the budget) and one that relays every
    request (P-RLD-MD), so the kills land on every hop."""
    direct = start_router(*worker_flags())
    relayed = start_router(*worker_flags(), "--link-gbps", "0.0001", "--ttft-budget-s", "0.05")
    return direct, relayed


async def _client(url: str, i: int, rng: random.Random, seen: dict[str, int]) -> str:
    body = {
        "model": "tiny",
        "prompt": f"conversation {i % 25}: the quick brown fox, turn {i}",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    kill = rng.choice(KILL_POINTS)
    async with httpx.AsyncClient(timeout=120) as http:
        if kill == "in_flight":  # gone before the headers, perhaps before P has the plan
            task = asyncio.create_task(http.post(f"{url}/v1/completions", json=body))
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return kill
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            pipeline = resp.headers["x-pdd-pipeline"]
            seen[pipeline] = seen.get(pipeline, 0) + 1
            if kill == "headers":
                return kill
            frames = rng.randint(1, 40) if kill == "tokens" else None
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and frames is not None:
                    frames -= 1
                    if frames == 0:
                        break
    return kill


async def _churn(urls: list[str], seed: int) -> tuple[dict[str, int], dict[str, int]]:
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    kills: dict[str, int] = {}
    gate = asyncio.Semaphore(CONCURRENT)

    async def one(i: int) -> None:
        async with gate:
            kill = await _client(urls[i % len(urls)], i, random.Random(rng.random()), seen)
            kills[kill] = kills.get(kill, 0) + 1

    await asyncio.gather(*(one(i) for i in range(STREAMS)))
    return seen, kills


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_clients_killed_at_random_points_leave_no_block_held(routers, cluster):
    idle = {r.url: _open_fds(r.proc.pid) for r in routers}
    seen, kills = asyncio.run(_churn([r.url for r in routers], seed=39))
    # The kills covered both pipelines (so P, RLD and MD) and every point of a stream.
    assert seen.get("P-MD", 0) > 0 and seen.get("P-RLD-MD", 0) > 0, seen
    assert set(kills) == set(KILL_POINTS), kills
    states = cluster.wait_quiescent(timeout_s=180)
    holding = {name: s for name, s in states.items() if not s.quiescent}
    assert not holding, holding
    for name in ("p", "rld", "md1", "md2"):
        s = states[name]
        assert s.live_requests == 0 and s.engine_requests == 0 and s.kv_blocks_locked == 0
        assert s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total
    # Connections the streams opened are idle in the pool now, closed once they expire
    # (worker_client.KEEPALIVE_EXPIRY_S) at the router's next poll.
    for r in routers:
        until_sync(
            lambda r=r: _open_fds(r.proc.pid) <= idle[r.url],
            f"router {r.url} back to the {idle[r.url]} fds it held idle before the churn",
        )
