"""Stub workers: the worker control API the router speaks, with no model behind it.

    python bench/stub_worker.py --role mono --count 8 --ports-file ports.json
                                [--token-rate 1000] [--secret S] [--block-size 16]

One process serves ``--count`` stub instances, each on its own loopback port (one
uvicorn server per instance, all on one event loop), so a router bench can put dozens of
instances in front of the router without dozens of interpreters on a small machine. Each
answers what ``pdd.router.worker_client`` calls, with the wire models of
``pdd.common.wire``: ``/health`` (identity, engine limits), ``/load`` (its live requests),
``/v1/pdd/cache-events`` (a ``BlockStored`` per new prompt block, so the router's prefix
index is fed exactly as by a real worker), ``/v1/pdd/requests`` (the plan), its NDJSON
``stream`` (``plan.sampling.max_tokens`` fake tokens at ``--token-rate`` per second),
cancel, handoff, takeover and ``wan-peers``. A prefill stub hands the plan on to the
plan's main decode over HTTP (what P's data plane does), with its own prefix hit, which
MD reports on its first token as ``cached_tokens``. ``GET /stub/stats`` (stub only) says
how many requests, prompt tokens and prefix-hit tokens the instance saw: the bench's
decision-quality figures. The ports are written to ``--ports-file`` once every server
listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE, block_hashes
from pdd.common.vocabulary import Role
from pdd.common.wire import (
    BlockStored,
    CacheEventsPage,
    Endpoint,
    EngineInfo,
    KVShape,
    LoadReport,
    PipelinePlan,
    TokenEvent,
    WorkerHealth,
)

#: How long a stream waits for its plan (the router opens streams and posts the plan at
#: once, and a prefill stub's hand-on reaches MD later) before it reports a failure.
PLAN_WAIT_S = 30.0
#: Cache events kept for the router's poll; an older cursor reads ``reset``.
EVENTS_KEPT = 50_000
#: The header a prefill stub hands its prefix hit on with (stub to stub only).
P_HIT_HEADER = "x-stub-p-hit"
#: A route's handler.
Handler = Callable[[Request], Awaitable[Response]]
#: Fake token ids: printable ASCII bytes of the tiny byte tokenizer, so text decodes.
FIRST_TOKEN_ID, TOKEN_SPAN = ord("a"), 26


@dataclass
class StubConfig:
    role: Role
    secret: str
    token_rate: float = 1000.0
    block_size: int = DEFAULT_BLOCK_SIZE
    capacity: int = 1024
    max_model_len: int = 1 << 20


@dataclass
class _Request:
    """One request at this instance: its plan once it arrived, and whether it was cancelled."""

    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    plan: PipelinePlan | None = None
    p_hit: int | None = None
    own_hit: int = 0
    cancelled: bool = False


@dataclass
class StubStats:
    """What the instance saw: the bench's load spread and prefix-hit figures."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    tokens_streamed: int = 0


class PrefixCache:
    """The blocks this instance holds (it never evicts) and the events the router reads."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._held: set[int] = set()
        self._events: list[BlockStored] = []
        self._first_cursor = 0  # the cursor of self._events[0], minus one

    def admit(self, prompt_ids: list[int]) -> int:
        """Hold ``prompt_ids``' full blocks; returns the prompt tokens it held before."""
        hashes = block_hashes(prompt_ids, self.block_size)
        held = 0
        while held < len(hashes) and hashes[held] in self._held:
            held += 1
        if held < len(hashes):
            new = hashes[held:]
            self._held.update(new)
            parent = hashes[held - 1] if held else None
            self._record(
                BlockStored(block_hashes=new, parent_hash=parent, block_size=self.block_size)
            )
        return held * self.block_size

    def _record(self, event: BlockStored) -> None:
        self._events.append(event)
        if len(self._events) > EVENTS_KEPT:
            drop = len(self._events) - EVENTS_KEPT
            del self._events[:drop]
            self._first_cursor += drop

    def page(self, instance_id: str, since: int) -> CacheEventsPage:
        """Events with cursors ``since+1 ..``, as ``CacheFeed.page`` answers."""
        next_cursor = self._first_cursor + len(self._events)
        reset = since < self._first_cursor or since > next_cursor
        start = 0 if reset else since - self._first_cursor
        return CacheEventsPage(
            instance_id=instance_id,
            next_cursor=next_cursor,
            reset=reset,
            events=list(self._events[start:]),
        )


class StubInstance:
    """One stub worker: its state and its Starlette app."""

    def __init__(
        self, config: StubConfig, instance_id: str, port: int, client: httpx.AsyncClient | None
    ) -> None:
        """``client`` carries a prefill stub's hand-on to MD (None: one that hands none on)."""
        self.config = config
        self.instance_id = instance_id
        url = f"http://127.0.0.1:{port}"
        self.endpoint = Endpoint(
            instance_id=instance_id,
            http_url=url,
            fast_addr=f"127.0.0.1:{port}",
            wan_addr=f"127.0.0.1:{port}",
        )
        self.cache = PrefixCache(config.block_size)
        self.stats = StubStats()
        self._requests: dict[str, _Request] = {}
        #: The client addresses streams were read from: one per connection the router used.
        self.stream_peers: set[tuple[str, int]] = set()
        self._client = client
        self.app = Starlette(routes=self._routes())

    # -- state --------------------------------------------------------------------------

    def _request(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            req = self._requests[request_id] = _Request()
        return req

    def health(self) -> WorkerHealth:
        blocks = self.config.max_model_len // self.config.block_size
        engine = EngineInfo(
            device="stub",
            dtype="float32",
            block_size=self.config.block_size,
            kv_blocks=blocks,
            kv_tokens=blocks * self.config.block_size,
            kv_bytes=blocks * self.config.block_size * 2048,
            max_running_requests=self.config.capacity,
            max_model_len=self.config.max_model_len,
            max_prompt_tokens=self.config.max_model_len,
            max_num_batched_tokens=8192,
            kv_shape=KVShape(
                num_layers=1, num_kv_heads=1, head_dim=256, dtype="float32", bytes_per_token=2048
            ),
        )
        return WorkerHealth(role=self.config.role, endpoint=self.endpoint, engine=engine)

    def load(self) -> LoadReport:
        running = sum(1 for r in self._requests.values() if r.plan is not None)
        blocks = self.config.max_model_len // self.config.block_size
        return LoadReport(
            instance_id=self.instance_id,
            role=self.config.role,
            running=min(running, self.config.capacity),
            waiting=max(0, running - self.config.capacity),
            kv_blocks_free=blocks,
            kv_blocks_total=blocks,
            relay_load=0.0,
            capacity=self.config.capacity,
        )

    async def accept(self, plan: PipelinePlan, p_hit: int | None) -> None:
        """Take a plan: count its prefix hit, hold its blocks, hand it on where P would."""
        hit = self.cache.admit(plan.prompt_ids)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(plan.prompt_ids)
        self.stats.hit_tokens += hit
        req = self._request(plan.request_id)
        req.plan, req.own_hit, req.p_hit = plan, hit, p_hit
        req.arrived.set()
        if self.config.role == Role.PREFILL and plan.main is not None:
            await self._hand_on(plan, hit)

    async def _hand_on(self, plan: PipelinePlan, hit: int) -> None:
        """What P's data plane does: bring the request to MD (here: its control API)."""
        assert plan.main is not None and self._client is not None
        resp = await self._client.post(
            f"{plan.main.http_url}/v1/pdd/requests",
            content=plan.model_dump_json(),
            headers={"Authorization": f"Bearer {self.config.secret}", P_HIT_HEADER: str(hit)},
        )
        resp.raise_for_status()

    async def events(self, request_id: str) -> AsyncIterator[TokenEvent]:
        """The instance's stream for one request: tokens where it decodes, else nothing."""
        req = self._request(request_id)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(req.arrived.wait(), PLAN_WAIT_S)
            plan = req.plan
            if plan is None:
                yield TokenEvent(
                    request_id=request_id, seq=0, source=self.instance_id, error="no plan came"
                )
                return
            if self.endpoint.instance_id not in {e.instance_id for e in plan.decode_sources}:
                return  # P's stream: no tokens, it closes once its part is done
            async for event in self._tokens(plan, req):
                yield event
        finally:
            self._requests.pop(request_id, None)

    async def _tokens(self, plan: PipelinePlan, req: _Request) -> AsyncIterator[TokenEvent]:
        n, pause = plan.sampling.max_tokens, 1.0 / self.config.token_rate
        cached = req.own_hit if req.p_hit is None else req.p_hit
        for seq in range(n):
            await asyncio.sleep(pause)
            if req.cancelled:
                return
            last = seq == n - 1
            self.stats.tokens_streamed += 1
            yield TokenEvent(
                request_id=plan.request_id,
                seq=seq,
                token_id=FIRST_TOKEN_ID + seq % TOKEN_SPAN,
                source=self.instance_id,
                finished=last,
                finish_reason="length" if last else None,
                cached_tokens=cached if seq == 0 else None,
                md_hit_tokens=req.own_hit if seq == 0 else None,
            )

    # -- HTTP ---------------------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token, self.config.secret)

    def _routes(self) -> list[Route]:
        def json_of(model: BaseModel) -> Response:
            return Response(model.model_dump_json(), media_type="application/json")

        def guarded(handler: Handler) -> Handler:
            async def check(request: Request) -> Response:
                if not self._authorized(request):
                    return _error(401, "unauthorized", "send Authorization: Bearer <shared secret>")
                return await handler(request)

            return check

        async def health(_: Request) -> Response:
            return json_of(self.health())

        async def probe(_: Request) -> Response:
            return JSONResponse({"ready": True})

        async def load(_: Request) -> Response:
            return json_of(self.load())

        async def cache_events(request: Request) -> Response:
            since = int(request.query_params.get("since", "0"))
            return json_of(self.cache.page(self.instance_id, since))

        async def start(request: Request) -> Response:
            try:
                plan = PipelinePlan.model_validate_json(await request.body())
            except ValidationError as exc:
                return _error(400, "invalid_request", str(exc))
            p_hit = request.headers.get(P_HIT_HEADER)
            await self.accept(plan, int(p_hit) if p_hit is not None else None)
            return JSONResponse(
                {"request_id": plan.request_id, "accepted_by": self.instance_id}, 202
            )

        async def stream(request: Request) -> Response:
            if request.client is not None:
                self.stream_peers.add((request.client.host, request.client.port))
            events = self.events(request.path_params["request_id"])
            return StreamingResponse(_ndjson(events), media_type="application/x-ndjson")

        async def cancel(request: Request) -> Response:
            request_id = request.path_params["request_id"]
            req = self._requests.get(request_id)
            if req is None:
                return _error(404, "not_found", f"no live request {request_id!r} on this instance")
            req.cancelled = True
            return JSONResponse({"request_id": request_id, "cancelled": True})

        async def accepted(request: Request) -> Response:
            return JSONResponse({"request_id": request.path_params["request_id"]})

        async def wan_peers(_: Request) -> Response:
            return Response(status_code=204)

        async def stats(_: Request) -> Response:
            return JSONResponse(vars(self.stats) | {"stream_connections": len(self.stream_peers)})

        rid = "/v1/pdd/requests/{request_id}"
        return [
            Route("/health", health),
            *(Route(p, probe) for p in ("/startup", "/live", "/ready")),
            Route("/load", load),
            Route("/metrics", lambda _: Response("", media_type="text/plain")),
            Route("/stub/stats", stats),
            Route("/v1/pdd/cache-events", guarded(cache_events)),
            Route("/v1/pdd/wan-peers", guarded(wan_peers), methods=["PUT"]),
            Route("/v1/pdd/requests", guarded(start), methods=["POST"]),
            Route(f"{rid}/stream", guarded(stream)),
            Route(rid, guarded(cancel), methods=["DELETE"]),
            Route(f"{rid}/handoff", guarded(accepted), methods=["POST"]),
            Route(f"{rid}/takeover", guarded(accepted), methods=["POST"]),
        ]


def _error(status: int, type_: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": type_, "message": message}}, status_code=status)


async def _ndjson(events: AsyncIterator[TokenEvent]) -> AsyncIterator[bytes]:
    async for event in events:
        yield event.model_dump_json(exclude_none=True).encode() + b"\n"


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the process (many share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen(port: int = 0) -> socket.socket:
    """A loopback listening socket. Its protocol is named (``IPPROTO_TCP``): asyncio turns
    Nagle's algorithm off only on such sockets' connections, and with it on, each answer's
    body (written after its head) waited 40 ms for the client's delayed ACK."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


async def serve(config: StubConfig, count: int, prefix: str, ports_file: Path | None) -> None:
    """Serve ``count`` instances until SIGTERM/SIGINT; write their ports once listening."""
    socks = [listen() for _ in range(count)]
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200, keepalive_expiry=2.0)
    async with httpx.AsyncClient(limits=limits, timeout=30.0) as client:
        instances = [
            StubInstance(config, f"{prefix}{k}", s.getsockname()[1], client)
            for k, s in enumerate(socks)
        ]
        servers = [
            _QuietServer(
                uvicorn.Config(i.app, log_level="warning", access_log=False, lifespan="off")
            )
            for i in instances
        ]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: [setattr(s, "should_exit", True) for s in servers])
        tasks = [
            asyncio.create_task(s.serve(sockets=[k])) for s, k in zip(servers, socks, strict=True)
        ]
        while not all(s.started for s in servers):
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        if ports_file is not None:
            ports = {i.instance_id: i.endpoint.http_url for i in instances}
            tmp = ports_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(ports))
            tmp.replace(ports_file)  # whole or absent: the bench polls for it
        await asyncio.gather(*tasks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=[r.value for r in Role], default="mono")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--prefix", help="instance ids are PREFIX0, PREFIX1, ... (default: the role)")
    p.add_argument("--secret", default="stub", help="the shared worker secret")
    p.add_argument("--token-rate", type=float, default=1000.0, help="tokens per second per stream")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--capacity", type=int, default=1024, help="requests each runs at once")
    p.add_argument("--ports-file", type=Path)
    args = p.parse_args(argv)
    if args.count < 1 or args.token_rate <= 0 or args.block_size < 1 or args.capacity < 1:
        p.error("--count, --token-rate, --block-size and --capacity must be positive")
    role = Role(args.role)
    config = StubConfig(role, args.secret, args.token_rate, args.block_size, args.capacity)
    asyncio.run(serve(config, args.count, args.prefix or f"{role}", args.ports_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
