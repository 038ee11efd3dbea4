"""The workers the router knows, kept fresh by one background poll loop.

Each poll asks every instance for its identity (``/health``, once), its load
(``/load``) and its new cache events (``/v1/pdd/cache-events?since=cursor``), which
feed the prefix index. An instance that fails a poll, or says it is draining (shutting
down: its running streams go on), is left out of decisions until
it answers again; one whose event feed says ``reset`` (it restarted, or events
were dropped) has its index entries rebuilt from what follows. Service hosts from
the operator's config are re-resolved every poll, so scaled pods come and go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass

from pydantic import ValidationError

from pdd.common.vocabulary import Role
from pdd.common.wire import Endpoint, EngineInfo, LoadReport
from pdd.router.config import WorkerRef
from pdd.router.prefix_index import BlockSizeMismatchError, PrefixIndex
from pdd.router.worker_client import WorkerCallError, WorkerClient

log = logging.getLogger(__name__)

#: Index housekeeping (dropping expired entries) every this many polls.
_EXPIRE_EVERY = 60


@dataclass
class Instance:
    role: Role
    http_url: str
    expected_id: str | None = None
    endpoint: Endpoint | None = None
    #: What its engine got (limits fixed at its start), read with the identity.
    engine: EngineInfo | None = None
    load: LoadReport | None = None
    ready: bool = False
    cursor: int = 0
    problem: str | None = None
    #: Why a request failed on it since its last good poll (None: no failure).
    suspected: str | None = None

    @property
    def instance_id(self) -> str | None:
        return self.endpoint.instance_id if self.endpoint else self.expected_id


def _trusted(ready: list[Instance]) -> list[Instance]:
    """``ready`` less its suspects, or all of it when every one is suspected."""
    return [i for i in ready if i.suspected is None] or ready


class MisconfiguredWorkerError(ValueError):
    """A worker reports another identity than the router was told."""


class InstanceRegistry:
    def __init__(
        self,
        refs: tuple[WorkerRef, ...],
        client: WorkerClient,
        index: PrefixIndex,
        interval_s: float,
    ) -> None:
        self._refs = refs
        self._client = client
        self._index = index
        self._interval_s = interval_s
        self._instances: dict[str, Instance] = {
            r.http_url: Instance(r.role, r.http_url, r.instance_id)
            for r in refs
            if r.dns_host is None
        }
        self._task: asyncio.Task | None = None
        self._polls = 0
        self._prompt_limit: int | None = None

    def ready(self, role: Role) -> list[Instance]:
        """The instances of ``role`` new requests may go to: those whose last poll
        answered, less those a request failed on since, unless that leaves none. A failed
        request does not prove the worker dead (a cut line fails it too, and then the
        worker is healthy); with an alternative the suspect is avoided, without one
        it is still tried, and the next poll settles it either way."""
        return _trusted([i for i in self._instances.values() if i.ready and i.role == role])

    def routable(self) -> list[Instance]:
        """Every role's :meth:`ready` instances, in one pass over the instances."""
        by_role: dict[Role, list[Instance]] = {}
        for inst in self._instances.values():
            if inst.ready:
                by_role.setdefault(inst.role, []).append(inst)
        return [inst for group in by_role.values() for inst in _trusted(group)]

    def all(self) -> list[Instance]:
        return list(self._instances.values())

    def suspect(self, instance_id: str, problem: str) -> None:
        """Avoid an instance now, not at the next poll: a request just failed on it.
        Its next successful poll clears it."""
        for inst in self._instances.values():
            if inst.instance_id == instance_id and inst.suspected is None:
                log.warning("%s worker at %s suspected: %s", inst.role, inst.http_url, problem)
                inst.suspected = problem

    def prompt_limit(self) -> int | None:
        """The longest prompt every ready instance that sees prompts first takes (P, or
        mono), as of the last poll; None before any has answered."""
        return self._prompt_limit

    def _update_prompt_limit(self) -> None:
        limits = [
            i.engine.max_prompt_tokens
            for i in self._instances.values()
            if i.ready and i.engine is not None and i.role in (Role.PREFILL, Role.MONO)
        ]
        self._prompt_limit = min(limits, default=None)

    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.create_task(self._loop(), name="worker-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        await self._resolve()
        await asyncio.gather(*(self._poll(i) for i in list(self._instances.values())))
        self._update_prompt_limit()
        self._polls += 1
        if self._polls % _EXPIRE_EVERY == 0:
            self._index.expire()

    async def _resolve(self) -> None:
        """Add an instance per address each Service host resolves to; drop vanished ones."""
        dns_refs = [r for r in self._refs if r.dns_host is not None]
        if not dns_refs:
            return
        loop = asyncio.get_running_loop()
        seen: set[str] = set()
        for ref in dns_refs:
            try:
                infos = await loop.getaddrinfo(ref.dns_host, ref.http_port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("cannot resolve %s workers at %s: %s", ref.role, ref.dns_host, exc)
                seen.update(u for u, i in self._instances.items() if i.role == ref.role)
                continue
            for info in infos:
                host = str(info[4][0])
                netloc = f"[{host}]" if ":" in host else host
                url = f"{ref.scheme}://{netloc}:{ref.http_port}"
                seen.add(url)
                self._instances.setdefault(url, Instance(ref.role, url))
        for url in set(self._instances) - seen:
            gone = self._instances.pop(url)
            if gone.instance_id is not None:
                self._index.forget_instance(gone.instance_id)

    async def _poll(self, inst: Instance) -> None:
        try:
            if inst.endpoint is None:
                inst.endpoint = await self._identify(inst)
            inst.load = await self._client.load(inst.http_url)
            page = await self._client.cache_events(inst.http_url, inst.cursor)
            if page.reset:
                self._index.forget_instance(inst.endpoint.instance_id)
            self._index.apply_all(inst.endpoint.instance_id, page.events)
            inst.cursor = page.next_cursor
        except (WorkerCallError, ValidationError, MisconfiguredWorkerError) as exc:
            self._set_problem(inst, str(exc))
            inst.endpoint = None  # re-read the identity: a restarted pod may differ
            return
        except BlockSizeMismatchError as exc:
            self._set_problem(inst, str(exc))
            return
        if inst.load.draining:  # its streams run on; new requests go elsewhere
            self._set_problem(inst, "draining: finishing its requests, taking no new ones")
            return
        if not inst.ready:
            log.info("%s worker %s is ready", inst.role, inst.instance_id)
        inst.ready, inst.problem, inst.suspected = True, None, None

    async def _identify(self, inst: Instance) -> Endpoint:
        health = await self._client.health(inst.http_url)
        endpoint, inst.engine = health.endpoint, health.engine
        if inst.expected_id is not None and endpoint.instance_id != inst.expected_id:
            raise MisconfiguredWorkerError(
                f"{inst.http_url} is instance {endpoint.instance_id!r}, not "
                f"{inst.expected_id!r}: fix the --{inst.role} flag"
            )
        # A first contact or a comeback: rebuild this instance's index entries from its
        # whole event log, so entries from a previous life of the process cannot linger.
        self._index.forget_instance(endpoint.instance_id)
        inst.cursor = 0
        return endpoint

    def _set_problem(self, inst: Instance, problem: str) -> None:
        if inst.ready or inst.problem != problem:
            log.warning("%s worker at %s left out: %s", inst.role, inst.http_url, problem)
        inst.ready, inst.problem = False, problem
