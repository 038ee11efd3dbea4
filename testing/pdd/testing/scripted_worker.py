"""Scripted workers for the router's own registry to poll, behind an in-process transport.

Router tests that need the registry, the dispatcher or the relay to meet workers, but not
the workers' engines, script what each worker answers the router's calls (``/health``,
``/load``, ``/v1/pdd/cache-events``, ``PUT`` wan-peers) from the wire models, over
``httpx.MockTransport``: no process, no socket, so they stay in the unit tier. Each such
test used to carry its own copy of this worker; a change to what a worker answers (a new
field of ``/health``, a new poll) is now made here once. A test varies the workers by
their fields (each one's role and engine, the cache events each publishes, which are late
or down) and, for the calls a test is about, by overriding ``answer_other``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import httpx
from pydantic import BaseModel

from pdd.common.cache_events import CacheEvent
from pdd.common.vocabulary import Role
from pdd.common.wire import CacheEventsPage, Endpoint, EngineInfo, LoadReport, WorkerHealth
from pdd.router.config import RouterConfig, WorkerRef
from pdd.router.runtime import RouterRuntime
from pdd.router.worker_client import WorkerClient

SECRET = "s"


def engine_info(
    *,
    block_size: int = 16,
    kv_tokens: int = 4096,
    max_model_len: int = 2048,
    engine: Literal["pdd", "vllm"] = "pdd",
) -> EngineInfo:
    """A small CPU engine as ``/health`` reports it; the limits a test is about are named."""
    return EngineInfo(
        engine=engine, device="cpu", dtype="float32", block_size=block_size,
        kv_blocks=kv_tokens // block_size, kv_tokens=kv_tokens, kv_bytes=1,
        max_running_requests=8, max_model_len=max_model_len,
        max_prompt_tokens=max_model_len - 1, max_num_batched_tokens=512,
    )  # fmt: skip


@dataclass
class ScriptedWorkers:
    """Workers by name (the host of their URL, ``http://<name>``), answering the router's
    polls. ``engines``: what each one's ``/health`` reports (``engine_info()`` where not
    named); ``events``: the cache events each has published, paged by the router's cursor;
    ``slow`` ones time out on their cache-events poll (connected, no answer in time);
    ``unconnected`` ones time out connecting for it (a starved host: a full accept queue,
    or the router's own loop too busy to see the connection made);
    ``down`` ones refuse every connection."""

    roles: Mapping[str, Role]
    engines: dict[str, EngineInfo] = field(default_factory=dict)
    events: dict[str, list[CacheEvent]] = field(default_factory=dict)
    slow: set[str] = field(default_factory=set)
    unconnected: set[str] = field(default_factory=set)
    down: set[str] = field(default_factory=set)

    def handle(self, request: httpx.Request) -> httpx.Response:
        """``httpx.MockTransport``'s handler: one worker's answer to one call."""
        name, path = request.url.host, request.url.path
        if name in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if path == "/health":
            return _json(self.health(name))
        if path == "/load":
            return _json(self.load(name))
        if path == "/v1/pdd/cache-events":
            if name in self.slow:
                raise httpx.ReadTimeout("timed out", request=request)
            if name in self.unconnected:
                raise httpx.ConnectTimeout("timed out", request=request)
            return _json(self.cache_events(name, int(request.url.params["since"])))
        return self.answer_other(name, request)

    def answer_other(self, name: str, request: httpx.Request) -> httpx.Response:
        """Any other call (wan-peers, a plan, a cancel): accepted with no body. A test
        about those calls overrides this."""
        return httpx.Response(204 if request.method == "PUT" else 200)

    def health(self, name: str) -> WorkerHealth:
        endpoint = Endpoint(
            instance_id=name, http_url=f"http://{name}", fast_addr="x:1", wan_addr="x:2"
        )
        engine = self.engines.get(name) or engine_info()
        return WorkerHealth(role=self.roles[name], endpoint=endpoint, engine=engine)

    def load(self, name: str) -> LoadReport:
        return LoadReport(
            instance_id=name, role=self.roles[name], running=0, waiting=0, kv_blocks_free=1,
            kv_blocks_total=1, relay_load=0.0, capacity=8,
        )  # fmt: skip

    def cache_events(self, name: str, since: int) -> CacheEventsPage:
        events = self.events.get(name, [])
        return CacheEventsPage(instance_id=name, next_cursor=len(events), events=events[since:])

    def router(self) -> RouterRuntime:
        """The router's runtime over these workers (its own registry, dispatcher and
        client), polling only when the test calls ``registry.poll_once()``."""
        refs = tuple(WorkerRef(role, f"http://{name}", name) for name, role in self.roles.items())
        config = RouterConfig(model="tiny", workers=refs, secret=SECRET, poll_interval_s=3600.0)
        client = WorkerClient(SECRET, transport=httpx.MockTransport(self.handle))
        return RouterRuntime(config, client=client)


def _json(answer: BaseModel) -> httpx.Response:
    return httpx.Response(200, content=answer.model_dump_json())
