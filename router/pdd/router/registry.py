"""The workers the router knows, kept fresh by one background poll loop.

Each poll asks every instance for its identity (``/health``, once), its load
(``/load``) and its new cache events (``/v1/pdd/cache-events?since=cursor``), which
feed the prefix index. An instance that fails a poll, or says it is draining (shutting
down: its running streams go on), is left out of decisions until
it answers again; one that only answers late (a connection or an answer past the client's
timeout: busy, not dead) is a suspect first, and left out once ``SLOW_POLLS_TO_LEAVE_OUT``
polls in a row were late; one whose event feed says ``reset`` (it restarted, or events
were dropped) has its index entries rebuilt from what follows. Service hosts from
the operator's config are re-resolved every poll, so scaled pods come and go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from pydantic import ValidationError

from pdd.common.vocabulary import Role
from pdd.common.wire import Endpoint, EngineInfo, LoadReport
from pdd.router.config import WorkerRef
from pdd.router.prefix_index import BlockSizeMismatchError, PrefixIndex
from pdd.router.worker_client import WorkerCallError, WorkerClient

log = logging.getLogger(__name__)

#: Index housekeeping (dropping expired entries) every this many polls.
_EXPIRE_EVERY = 60
#: Polls in a row a worker may answer too late (no connection or no answer within the
#: client's timeout) before it is left out; until then it is a suspect, routable while its role
#: has nobody better. As Kubernetes' readiness probe (failureThreshold 3): a worker busy
#: computing on a loaded node answers late, and a lone instance of its role left out at
#: its first late answer took every request with it (503) until it caught up.
SLOW_POLLS_TO_LEAVE_OUT = 3


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
    #: The main decodes this prefill worker was last told of (``warm_wan_peers``).
    told_main_decodes: frozenset[str] | None = None
    #: Its polls answered too late since its last good one (``SLOW_POLLS_TO_LEAVE_OUT``).
    late_polls: int = 0

    @property
    def instance_id(self) -> str | None:
        return self.endpoint.instance_id if self.endpoint else self.expected_id


@dataclass
class _RoleMembers:
    """One role's ready instances (by URL) and which of them are suspected, kept as they
    change, so whether a suspect is routable (only when every instance of its role is
    suspected) is known without a scan."""

    ready: set[str] = field(default_factory=set)
    suspected: set[str] = field(default_factory=set)
    #: Whether suspects were left out when the changes were last taken.
    trusting: bool = False

    @property
    def has_trusted(self) -> bool:
        return len(self.ready) > len(self.suspected)


@dataclass
class _EngineLimits:
    """The context windows and, per role, the KV pools of the ready instances whose engine
    is known, counted as they change: a request reads the smallest of each without a
    pass over the fleet (few distinct values: a deployment serves one model)."""

    context: Counter[int] = field(default_factory=Counter)
    kv_tokens: dict[Role, Counter[int]] = field(default_factory=dict)
    #: What each instance (by URL) adds now.
    counted: dict[str, tuple[Role, EngineInfo]] = field(default_factory=dict)

    def set(self, url: str, role: Role, engine: EngineInfo | None) -> None:
        """``url``'s contribution from now on (None: it adds nothing)."""
        old = self.counted.pop(url, None)
        if old is not None:
            _drop(self.context, old[1].max_model_len)
            _drop(self.kv_tokens[old[0]], old[1].kv_tokens)
        if engine is not None:
            self.counted[url] = (role, engine)
            self.context[engine.max_model_len] += 1
            self.kv_tokens.setdefault(role, Counter())[engine.kv_tokens] += 1

    def smallest_kv(self, roles: Collection[Role]) -> int | None:
        return min((min(self.kv_tokens[r]) for r in roles if self.kv_tokens.get(r)), default=None)


def _drop(counts: Counter[int], value: int) -> None:
    counts[value] -= 1
    if counts[value] == 0:
        del counts[value]


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
        self._members: dict[Role, _RoleMembers] = {}
        #: URLs whose routing inputs (readiness, suspicion, load, identity) changed since
        #: the router last took them (``take_changes``).
        self._changed: set[str] = set()
        self._watcher: Callable[[], None] | None = None
        self._limits = _EngineLimits()

    def ready(self, role: Role) -> list[Instance]:
        """The instances of ``role`` new requests may go to: those whose last poll
        answered, less those a request failed on since, unless that leaves none. A failed
        request does not prove the worker dead (a cut line fails it too, and then the
        worker is healthy); with an alternative the suspect is avoided, without one
        it is still tried, and the next poll settles it either way."""
        return [i for i in self._instances.values() if i.role == role and self.routes_to(i)]

    def routable(self) -> list[Instance]:
        """Every role's :meth:`ready` instances."""
        return [i for i in self._instances.values() if self.routes_to(i)]

    def all(self) -> list[Instance]:
        return list(self._instances.values())

    def take_changes(self) -> list[tuple[str, Instance | None]]:
        """Each instance (by URL; None once gone) whose routing inputs changed since the
        last call, so the router updates only those (the whole role when its last
        unsuspected instance left or came back: its suspects' standing changed)."""
        for members in self._members.values():
            if members.has_trusted != members.trusting:
                members.trusting = members.has_trusted
                self._changed |= members.ready
        changes = [(url, self._instances.get(url)) for url in self._changed]
        self._changed.clear()
        return changes

    def watch(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change`` after each change of routing inputs, so the router takes
        the changes as polls and suspicions bring them, not on a request's path (at
        10,000 instances polled twice a second, a hundred between two requests)."""
        self._watcher = on_change

    def routes_to(self, inst: Instance) -> bool:
        """Whether new requests may go to ``inst`` now (see :meth:`ready`)."""
        if not inst.ready or inst.endpoint is None:
            return False
        return inst.suspected is None or not self._role_members(inst.role).has_trusted

    def has_routable(self, role: Role) -> bool:
        return bool(self._role_members(role).ready)

    def _role_members(self, role: Role) -> _RoleMembers:
        members = self._members.get(role)
        if members is None:
            members = self._members[role] = _RoleMembers()
        return members

    def _touch(self, inst: Instance) -> None:
        """Record that ``inst``'s routing inputs changed (call after every change)."""
        url, members = inst.http_url, self._role_members(inst.role)
        ready = inst.ready and url in self._instances
        (members.ready.add if ready else members.ready.discard)(url)
        suspected = ready and inst.suspected is not None
        (members.suspected.add if suspected else members.suspected.discard)(url)
        self._limits.set(url, inst.role, inst.engine if ready else None)
        self._changed.add(url)
        if self._watcher is not None:
            self._watcher()

    def suspect(self, instance_id: str, problem: str) -> None:
        """Avoid an instance now, not at the next poll: a request just failed on it.
        Its next successful poll clears it."""
        for inst in self._instances.values():
            if inst.instance_id == instance_id:
                self._suspect(inst, problem)

    def _suspect(self, inst: Instance, problem: str) -> None:
        if inst.suspected is None:
            log.warning("%s worker at %s suspected: %s", inst.role, inst.http_url, problem)
            inst.suspected = problem
            self._touch(inst)

    def prompt_limit(self) -> int | None:
        """The longest prompt every ready instance that sees prompts first takes (P, or
        mono), as of the last poll; None before any has answered."""
        return self._prompt_limit

    def context_limit(self) -> int | None:
        """The model's context window (prompt plus output), the smallest any ready instance
        has (a request's tokens end on MD or RLD, after P), as of the last poll; None
        before any has answered."""
        return min(self._limits.context, default=None)

    def kv_limit(self, roles: Collection[Role]) -> int | None:
        """The smallest KV pool, in tokens (``EngineInfo.kv_tokens``), of the ready
        instances of ``roles``: the most one request can hold there, even with the pool
        to itself (it may be less than the context window); None before any answered."""
        return self._limits.smallest_kv(roles)

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
        await self._tell_main_decodes()
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
            self._touch(gone)
            await self._client.forget(url)  # its pooled connections, once its calls end
            if gone.instance_id is not None:
                self._index.forget_instance(gone.instance_id)

    async def _poll(self, inst: Instance) -> None:
        try:
            if inst.endpoint is None:
                inst.endpoint = await self._identify(inst)
            load = await self._client.load(inst.http_url)
            moved, inst.load = load != inst.load, load
            page = await self._client.cache_events(inst.http_url, inst.cursor)
            if page.reset:
                self._index.forget_instance(inst.endpoint.instance_id)
            self._index.apply_all(inst.endpoint.instance_id, page.events)
            inst.cursor = page.next_cursor
        except WorkerCallError as exc:
            if exc.late and inst.ready and inst.late_polls + 1 < SLOW_POLLS_TO_LEAVE_OUT:
                inst.late_polls += 1
                self._suspect(inst, f"poll answered late: {exc}")
                return
            inst.endpoint = None  # re-read the identity: a restarted pod may differ
            self._set_problem(inst, str(exc))
            return
        except (ValidationError, MisconfiguredWorkerError) as exc:
            inst.endpoint = None
            self._set_problem(inst, str(exc))
            return
        except BlockSizeMismatchError as exc:
            self._set_problem(inst, str(exc))
            return
        inst.late_polls = 0
        if inst.load.draining:  # its streams run on; new requests go elsewhere
            self._set_problem(inst, "draining: finishing its requests, taking no new ones")
            return
        if moved or not inst.ready or inst.suspected is not None:
            self._mark_ready(inst)

    async def _tell_main_decodes(self) -> None:
        """Name the ready main decodes to each ready prefill worker whose last word was
        another set, so it opens its WAN channels to a main decode before the first
        request there (``PrefillRole.warm_wan_peers``). A failed call is told again at
        the next poll."""
        mains = [i.endpoint for i in self.ready(Role.MAIN) if i.endpoint is not None]
        names = frozenset(e.instance_id for e in mains)
        stale = [p for p in self.ready(Role.PREFILL) if p.told_main_decodes != names]
        if not mains or not stale:
            return
        told = await asyncio.gather(
            *(self._client.warm_wan_peers(p.http_url, mains) for p in stale),
            return_exceptions=True,
        )
        for inst, result in zip(stale, told, strict=True):
            if isinstance(result, WorkerCallError):
                log.debug("could not name the main decodes to %s: %s", inst.http_url, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                inst.told_main_decodes = names

    def _mark_ready(self, inst: Instance) -> None:
        """What a good poll concludes: the instance takes requests, suspicion cleared."""
        if not inst.ready:
            log.info("%s worker %s is ready", inst.role, inst.instance_id)
        inst.ready, inst.problem, inst.suspected = True, None, None
        self._touch(inst)

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
        inst.told_main_decodes = None  # a restarted prefill worker holds no channels
        return endpoint

    def _set_problem(self, inst: Instance, problem: str) -> None:
        if inst.ready or inst.problem != problem:
            log.warning("%s worker at %s left out: %s", inst.role, inst.http_url, problem)
        inst.ready, inst.problem = False, problem
        self._touch(inst)
