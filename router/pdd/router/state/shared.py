"""A Redis-shared store that never blocks the router and survives Redis going away.

Every call to Redis is a ``redis.asyncio`` coroutine: nothing here, nor in
``redis_store``, makes a synchronous Redis call on the event loop (the router imports
no synchronous client at all). Two paths, chosen for what each one costs a request:

* **Reads on the decision path** (``holders``: the prefix lookup; ``inflight``: other
  replicas' loads) are awaited with a per-call deadline (``deadline_s``, 0.25 s by
  default). A lookup must be fresh to be worth anything: what other replicas confirmed
  a moment ago is what makes a conversation's next turn land on the MD holding its KV,
  and a background copy of the whole index would cost O(index) per refresh. Redis
  answers in well under a millisecond, so the deadline only matters when it is down or
  hung; then the call is abandoned (other requests and ``/health`` are served meanwhile:
  nothing blocks the loop), the store goes *down*, and every later request reads the
  local store at once, without touching Redis, until Redis is back.
* **Writes** (index entries from the poll loop, ``expect`` and ``confirm``, lease
  counts, expiry) land in the local store at once and are queued for Redis, sent in order by one
  background task (write-behind): the request that causes them never waits. A full
  queue means Redis cannot keep up; the store goes down and re-seeds later, as after an
  outage. The price is that another replica sees a write one flush later (the task runs
  as soon as the loop is free). This replica's own in-flight counts always come from
  local memory, never back from Redis.
* **Other replicas' in-flight counts** are read at most once per ``loads_refresh_s``
  (0.1 s by default) and summed with this replica's own counts as they are read: the
  read is SMEMBERS plus one HGETALL per other replica, as many fields as instances they
  have requests on, so reading it for every decision made Redis traffic per request grow
  with the busy fleet. On a budget it costs a fixed number of reads per second, however
  many requests arrive; the counts are at most that much older (a replica's lease writes
  reach Redis a flush later anyway, and the workers' own load reports lag a poll).

States: *up* (reads from Redis, writes sent); *down* (reads local, writes dropped for
Redis: the re-seed will carry them); *seeding* (Redis answered a probe: this replica
copies its local state into it, index entries with their original times and its
in-flight counts, while new writes queue behind the copy; then *up*). A restarted,
empty Redis would otherwise make every replica forget every prefix. The background task
also publishes this replica's counts every heartbeat (so its load key does not expire)
and, while down, probes Redis every heartbeat.

Failover: the URL may be a comma-separated list (``redis://a:6379/0,redis://b:6379/0``).
The store uses one Redis at a time; each probe (at start, and every heartbeat while
down) tries the one in use first, then the others in the list's order, and re-seeds the
first that answers, so a second Redis that replaces a dead first one is filled from
every replica's local state and serving resumes there. Requests never wait for any of
this (they are served from local state meanwhile). A replica stays on the Redis it
reached until that one fails, so a replaced Redis must not come back at its old address
while replicas use the new one (or put a Service in front and give one URL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

import redis.asyncio
from redis.exceptions import RedisError

from pdd.router.prefix_index import IndexStore
from pdd.router.state.memory import LocalStore
from pdd.router.state.redis_store import RedisIndexStore, RedisLoads

log = logging.getLogger(__name__)
T = TypeVar("T")
Op = Callable[[], Awaitable[object]]

#: A request waits at most this long for Redis before it is served from local state.
DEADLINE_S = 0.25
#: Writes, expiry and the re-seed hold no request; a slower Redis is not a dead one.
_BACKGROUND_DEADLINE_S = 5.0
#: Writes queued beyond this mean Redis cannot keep up: go down, re-seed later.
_MAX_QUEUED = 10_000
#: Index entries per re-seed round trip.
_SEED_BATCH = 512
#: Other replicas' in-flight counts are read from Redis at most this often.
LOADS_REFRESH_S = 0.1


class SharedStore:
    def __init__(
        self,
        url: str,
        replica_id: str,
        ttl_s: float,
        heartbeat_s: float = 1.0,
        prefix: str = "pdd:",
        on_change: Callable[[bool], None] = lambda up: None,
        deadline_s: float = DEADLINE_S,
        loads_refresh_s: float = LOADS_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if loads_refresh_s < 0:
            raise ValueError(f"loads_refresh_s must be >= 0, got {loads_refresh_s}")
        self._local = LocalStore(ttl_s)
        self.urls = [u.strip() for u in url.split(",") if u.strip()]
        if not self.urls:
            raise ValueError(f"no Redis URL in {url!r}")
        self._clients = [
            redis.asyncio.Redis.from_url(
                u,
                socket_connect_timeout=deadline_s,
                socket_timeout=max(deadline_s, _BACKGROUND_DEADLINE_S),  # a backstop only
            )
            for u in self.urls
        ]
        self._ttl_s, self._prefix, self._replica_id = ttl_s, prefix, replica_id
        self._heartbeat_s = heartbeat_s
        self._use(0)
        self._deadline_s = deadline_s
        self._on_change = on_change
        self._up = False
        #: Outages so far: a call that fails after a newer outage began was answered by
        #: that one already (and must not undo a re-seed under way).
        self._outages = 0
        self._reads_waiting = 0
        self._accepting = False  # writes queue for Redis (seeding or up)
        self._writes: deque[Op] = deque()
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()
        self._settled.set()
        self._next_beat = 0.0
        self._index = _FailoverIndex(self, self._local.index)
        #: The other replicas' counts as last read, and the instances whose count
        #: differed from the read before (for ``take_moved``).
        self._others: dict[str, int] = {}
        self._others_moved: set[str] = set()
        self._loads_refresh_s = loads_refresh_s
        self._clock = clock
        self._others_due = -float("inf")  # when the others' counts are to be read again
        self._task: asyncio.Task | None = None
        self._closing = False

    def _use(self, at: int) -> None:
        """Talk to the ``at``-th Redis of the list from now on."""
        self.at = at
        self._client = self._clients[at]
        self.remote = RedisIndexStore(self._client, self._ttl_s, self._prefix)
        self._loads = RedisLoads(
            self._client, self._replica_id, 5 * self._heartbeat_s, self._prefix
        )

    @property
    def index(self) -> IndexStore:
        return self._index

    @property
    def shared(self) -> bool:
        return self._up

    @property
    def reads_waiting(self) -> int:
        return self._reads_waiting

    def add_inflight(self, instance: str, delta: int) -> None:
        self._local.add_inflight(instance, delta)
        self.write(lambda: self._loads.add(instance, delta))

    async def inflight(self) -> Mapping[str, int]:
        """Every replica's counts: the others' as last read (read again when the budget
        allows), plus this replica's own, summed per lookup rather than copied."""
        if not self._up:
            self._set_others({})  # down: this replica's counts only, as before any read
        elif self._clock() >= self._others_due:
            # Due before the await: decisions meanwhile use the counts read last.
            self._others_due = self._clock() + self._loads_refresh_s
            self._set_others(await self._read(self._loads.others) or {})
        own = self._local.live_counts()
        return _Summed(self._others, own) if self._others else own

    def _set_others(self, others: dict[str, int]) -> None:
        if others or self._others:
            self._others_moved.update(key for key, _ in self._others.items() ^ others.items())
        self._others = others

    def take_moved(self) -> set[str]:
        moved = self._local.take_moved() | self._others_moved
        self._others_moved = set()
        return moved

    async def holders(self, hashes: Sequence[int], now: float) -> list[set[str]]:
        remote = await self._read(lambda: self.remote.holders(hashes, now))
        return remote if remote is not None else self._local.index.holders(hashes, now)

    def write(self, op: Op) -> None:
        """Queue ``op`` for Redis (dropped while down: the re-seed carries its effect)."""
        if not self._accepting:
            return
        if len(self._writes) >= _MAX_QUEUED:
            self._set_down(f"{_MAX_QUEUED} writes queued; Redis is not keeping up")
            return
        self._writes.append(op)
        self._settled.clear()
        self._wake.set()

    async def settled(self) -> None:
        """Wait until every write queued so far was sent (or dropped by an outage)."""
        await self._settled.wait()

    async def start(self) -> None:
        await self._try_resync()
        self._task = asyncio.create_task(self._run(), name="redis-writer")

    async def close(self) -> None:
        """Stop the writer, then the client. The flag ends the writer's loop even when the
        cancel is lost: ``wait_for`` can swallow a cancel that lands as its own timeout
        fires, and the loop would then run on (seen as a close that never returned)."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._up:  # leave the replica set now (a killed replica's entry expires)
            await self._call(self._loads.leave, self._deadline_s)
        for client in self._clients:
            await client.aclose()

    async def _read(self, op: Callable[[], Awaitable[T]]) -> T | None:
        """``op``'s answer while Redis is up and answers within the deadline, else None."""
        if not self._up:
            return None
        self._reads_waiting += 1
        try:
            return await self._call(op, self._deadline_s)
        finally:
            self._reads_waiting -= 1

    async def _call(self, op: Callable[[], Awaitable[T]], deadline_s: float) -> T | None:
        outages = self._outages
        try:
            return await asyncio.wait_for(op(), deadline_s)
        except (RedisError, TimeoutError) as exc:
            if outages == self._outages:
                self._set_down(f"{exc!r} after at most {deadline_s} s")
            return None

    async def _run(self) -> None:
        while not self._closing:
            if self._up:
                await self._flush()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._heartbeat_s)
            else:
                await asyncio.sleep(self._heartbeat_s)
                await self._try_resync()

    async def _flush(self) -> None:
        """Send the queued writes in order, then the heartbeat when it is due."""
        self._wake.clear()
        while self._writes and self._up and not self._closing:
            await self._call(self._writes.popleft(), _BACKGROUND_DEADLINE_S)
        if not self._writes:
            self._settled.set()
        if self._up and time.monotonic() >= self._next_beat:
            self._next_beat = time.monotonic() + self._heartbeat_s
            counts = self._local.counts()
            await self._call(lambda: self._loads.publish(counts), _BACKGROUND_DEADLINE_S)

    async def _try_resync(self) -> None:
        """Copy the local state into the first Redis that answers (the one in use, then
        the rest of the list). The snapshot is taken before the first await and writes
        queue from then on, so none slips between the two."""
        entries = self._local.index.entries()
        counts = self._local.counts()
        outages = self._outages
        self._accepting = True
        order = [(self.at + i) % len(self._clients) for i in range(len(self._clients))]
        failures = []
        for at in order:
            try:
                await asyncio.wait_for(self._clients[at].ping(), self._deadline_s)
            except (RedisError, TimeoutError) as exc:
                failures.append(f"{self.urls[at]}: {exc!r}")
                continue
            if at != self.at:
                log.warning("redis at %s answers: failing over to it", self.urls[at])
                self._use(at)
            break
        else:
            self._set_down("; ".join(failures))
            if self._task is None:  # first attempt: say why once
                log.warning("redis unavailable at start (%s): serving from local state", failures)
            return
        try:
            for start in range(0, len(entries), _SEED_BATCH):
                by_instance: dict[str, list[tuple[int, float]]] = {}
                for instance, h, seen in entries[start : start + _SEED_BATCH]:
                    by_instance.setdefault(instance, []).append((h, seen))
                for instance, items in by_instance.items():
                    await asyncio.wait_for(
                        self.remote.add_entries(instance, items), _BACKGROUND_DEADLINE_S
                    )
            await asyncio.wait_for(self._loads.publish(counts), _BACKGROUND_DEADLINE_S)
        except (RedisError, TimeoutError) as exc:
            self._set_down(repr(exc))
            return
        if outages != self._outages:  # lost again while seeding: the next probe retries
            return
        self._next_beat = time.monotonic() + self._heartbeat_s
        self._set_up(True, f"{self.urls[self.at]}: re-seeded {len(entries)} index entries")
        self._wake.set()

    def _set_down(self, detail: str) -> None:
        self._outages += 1
        self._accepting = False
        self._writes.clear()
        self._settled.set()
        self._set_up(False, f"{detail}; serving from local state")

    def _set_up(self, up: bool, detail: str) -> None:
        if up == self._up:
            return
        self._up = up
        if up:
            log.info("redis store available: %s", detail)
        else:
            log.warning("redis store lost: %s", detail)
        self._on_change(up)


class _Summed(Mapping[str, int]):
    """Two count mappings read as their sum, without building it: a decision reads only
    the instances that moved, so a copy would cost O(busy instances) per request."""

    def __init__(self, a: Mapping[str, int], b: Mapping[str, int]) -> None:
        self._a, self._b = a, b

    def __getitem__(self, key: str) -> int:
        if key not in self._a and key not in self._b:
            raise KeyError(key)
        return self._a.get(key, 0) + self._b.get(key, 0)

    def get(self, key: str, default: int | None = None) -> int | None:  # type: ignore[override]
        if key not in self._a and key not in self._b:
            return default
        return self._a.get(key, 0) + self._b.get(key, 0)

    def __iter__(self) -> Iterator[str]:
        yield from self._a
        yield from (key for key in self._b if key not in self._a)

    def __len__(self) -> int:
        return len(self._a) + sum(1 for key in self._b if key not in self._a)


class _FailoverIndex:
    """The ``IndexStore`` the prefix index writes through: the local store at once, Redis
    behind (``SharedStore.write``; whichever Redis the store uses when the write is
    sent). Its ``holders`` is the local store's; the router's decision path asks
    ``SharedStore.holders``, which prefers Redis."""

    def __init__(self, store: SharedStore, local: IndexStore) -> None:
        self._store, self._local = store, local

    def add(self, instance: str, hashes: Iterable[int], now: float) -> None:
        hashes = list(hashes)
        self._local.add(instance, hashes, now)
        self._store.write(lambda: self._store.remote.add(instance, hashes, now))

    def remove(self, instance: str, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        self._local.remove(instance, hashes)
        self._store.write(lambda: self._store.remote.remove(instance, hashes))

    def clear(self, instance: str) -> None:
        self._local.clear(instance)
        self._store.write(lambda: self._store.remote.clear(instance))

    def holders(self, hashes: Sequence[int], now: float) -> list[set[str]]:
        return self._local.holders(hashes, now)

    def expire(self, now: float) -> int:
        self._store.write(lambda: self._store.remote.expire(now))
        return self._local.expire(now)
