"""The whole data plane in one process, on a virtual clock: deterministic by construction.

Workers are assembled exactly as ``pdd worker`` assembles them (``WorkerInstance``),
with three substitutions that take the machine out of the result:

- each engine is stepped on the event loop (``LoopEngineRunner``), every step
  costing ``STEP_S`` of loop time;
- peers talk over a ``MemoryNetwork`` instead of sockets; a WAN-facing worker
  has the real WAN link emulator (``WanLink``, host ``<name>-wan``) in front of its
  data port, on that same network, and the path to the emulator can be paused, cut,
  delayed or made lossy (``wan_path``);
- the control API is served through an in-process HTTP transport, and requests
  run through the router's own stream relay with the router's ``WorkerClient``.

Under a virtual clock (the ``virtual_clock`` marker) how many tokens a relay decodes
while its KV crosses a line of a given rate is a property of the scenario, the same
on every machine. ``crash(name)`` does what SIGKILL does to a worker, at an exact
point of the run. Loaded by path (``--import-mode=importlib``): see conftest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import httpx
import openai

from pdd.common.kv_codec import NO_CODEC, KVCodec
from pdd.common.vocabulary import Role
from pdd.common.wire import Endpoint, StateReport
from pdd.local.cluster import LinkSpec, PlanBuilder, WorkerSpec
from pdd.local.probes import flatten
from pdd.router.app import create_app
from pdd.router.config import RouterConfig, WorkerRef
from pdd.router.runtime import RouterRuntime
from pdd.router.worker_client import WorkerClient
from pdd.testing.asgi import StreamingASGITransport
from pdd.testing.memory_network import LinkFaults, MemoryNetwork
from pdd.testing.waiting import WaitTimeout, until
from pdd.wan.link import WanLink
from pdd.worker.engine import Engine
from pdd.worker.engine_runner import LoopEngineRunner
from pdd.worker.instance import WorkerInstance
from pdd.worker.model.loader import LoadedModel
from pdd.worker.roles.base import RoleBase, WorkerSettings

#: Loop time one engine step takes: 200 steps per second per instance.
STEP_S = 0.005
HTTP_PORT, DATA_PORT, WAN_PORT = 8000, 9000, 9100


@dataclass
class InProcessWorker:
    instance: WorkerInstance
    link: WanLink | None  # the WAN link emulator in front of the data port, if WAN-facing
    alive: bool = True

    @property
    def role(self) -> RoleBase:
        return self.instance.role

    @property
    def endpoint(self) -> Endpoint:
        return self.instance.settings.endpoint

    @property
    def url(self) -> str:
        return self.endpoint.http_url

    def metrics(self) -> dict[str, float]:
        """What ``GET /metrics`` would answer, keyed ``name{label="v"}``."""
        self.role.refresh_gauges()
        return flatten(self.role.metrics.render().decode())

    def state(self) -> StateReport:
        return self.role.state_report()


class InProcessCluster(PlanBuilder):
    """Workers named by their specs; ``async with`` starts and stops them all."""

    def __init__(
        self,
        model: LoadedModel,
        specs: Sequence[WorkerSpec],
        link: LinkSpec,
        *,
        secret: str = "pdd-test-secret",
        block_size: int = 16,
        num_blocks: int = 1024,
        transfer_timeout_s: float = 30.0,
        kv_codecs: Mapping[str, KVCodec] | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.model = model
        self.specs = specs
        self.link_spec = link
        self.secret = secret
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.transfer_timeout_s = transfer_timeout_s
        self.kv_codecs = dict(kv_codecs or {})  # a worker's --kv-codec, by name (else none)
        #: Every engine's step budget (None: the engine's default): a small one prefills a
        #: test's prompt in several chunks, so P streams its KV while it prefills.
        self.max_num_batched_tokens = max_num_batched_tokens
        self.network = MemoryNetwork()
        self.http = StreamingASGITransport()
        self.workers: dict[str, InProcessWorker] = {}
        self._stopping: list[asyncio.Future[None]] = []  # crashed workers winding down

    def __getitem__(self, name: str) -> InProcessWorker:
        return self.workers[name]

    async def __aenter__(self) -> InProcessCluster:
        try:
            for spec in self.specs:
                self.workers[spec.name] = await self._start(spec)
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def client(self) -> WorkerClient:
        """The router's worker client, reaching the workers' apps in-process."""
        return WorkerClient(self.secret, timeout_s=30.0, transport=self.http)

    @contextlib.asynccontextmanager
    async def router(
        self, workers: Sequence[tuple[Role, str]], **config: object
    ) -> AsyncIterator[RouterRuntime]:
        """A router over the named workers. It polls them once at start; the hour between
        polls keeps any later poll from deciding anything in a test."""
        refs = tuple(WorkerRef(role, self[name].url, name) for role, name in workers)
        settings = RouterConfig(
            workers=refs,
            secret=self.secret,
            block_size=self.block_size,
            poll_interval_s=3600.0,
            **config,  # type: ignore[arg-type]
        )
        runtime = RouterRuntime(settings, client=self.client())
        await runtime.start()
        try:
            yield runtime
        finally:
            await runtime.close()

    @contextlib.asynccontextmanager
    async def openai_client(
        self, runtime: RouterRuntime, host: str
    ) -> AsyncIterator[openai.AsyncOpenAI]:
        """The official openai SDK's async client, talking to ``runtime``'s app served
        in-process as ``host``."""
        self.http.apps[host] = create_app(runtime)
        http = httpx.AsyncClient(transport=self.http, timeout=60.0)
        client = openai.AsyncOpenAI(
            base_url=f"http://{host}/v1", api_key="none", http_client=http, max_retries=0
        )
        try:
            yield client
        finally:
            await client.close()

    def wan_path(self, name: str) -> LinkFaults:
        """The faults of the path from the other datacenter to ``name``'s WAN link."""
        return self.network.link(f"{name}-wan", WAN_PORT)

    def fast_path(self, name: str) -> LinkFaults:
        """The faults of the in-datacenter path to ``name``'s data port."""
        return self.network.link(name, DATA_PORT)

    def crash(self, name: str) -> None:
        """Kill ``name`` now, as SIGKILL would: its connections reset, its HTTP streams break,
        its ports refuse, and it does nothing more (its WAN link emulator lives on)."""
        worker = self.workers[name]
        worker.alive = False
        self.network.crash(name)
        self.http.crash(f"{name}:{HTTP_PORT}")
        self._stopping.append(asyncio.ensure_future(worker.instance.stop()))

    async def wait_quiescent(self, timeout_s: float = 30.0) -> dict[str, StateReport]:
        """Wait (loop time) until no live worker holds request state, locks or blocks;
        the last reports either way (the caller says which leaked)."""

        def states() -> dict[str, StateReport]:
            return {name: w.state() for name, w in self.workers.items() if w.alive}

        with contextlib.suppress(WaitTimeout):
            await until(lambda: all(s.quiescent for s in states().values()), "quiet", timeout_s)
        return states()

    async def stop(self) -> None:
        for worker in self.workers.values():
            if worker.link is not None:
                await worker.link.stop()
            if worker.alive:
                await worker.instance.stop()
        await asyncio.gather(*self._stopping)

    async def _start(self, spec: WorkerSpec) -> InProcessWorker:
        name = spec.name
        wan_addr = f"{name}-wan:{WAN_PORT}" if spec.wan_facing else f"{name}:{DATA_PORT}"
        settings = WorkerSettings(
            role=spec.role,  # type: ignore[arg-type]
            instance_id=name,
            secret=self.secret,
            transfer_timeout_s=self.transfer_timeout_s,
            advertise_fast=f"{name}:{DATA_PORT}",
            advertise_wan=wan_addr,
            http=f"{name}:{HTTP_PORT}",
            kv_codec=self.kv_codecs.get(name, NO_CODEC),
        )
        if spec.args:
            raise ValueError(f"in-process workers take no worker flags, not {spec.args}")
        options = {}
        if self.max_num_batched_tokens is not None:
            options["max_num_batched_tokens"] = self.max_num_batched_tokens
        engine = Engine(
            self.model, block_size=self.block_size, num_blocks=self.num_blocks, **options
        )
        runner = LoopEngineRunner(engine, asyncio.get_running_loop(), STEP_S)
        instance = WorkerInstance(settings, runner, self.network.host(name))
        await instance.start(f"{name}:{DATA_PORT}")
        self.http.apps[f"{name}:{HTTP_PORT}"] = instance.app
        link = None
        if spec.wan_facing:
            s = self.link_spec
            link = WanLink(
                wan_addr,
                f"{name}:{DATA_PORT}",
                s.gbps,
                s.rtt_ms,
                s.jitter_ms,
                partition_grace_s=s.partition_grace_s,
                seed=0,
                network=self.network.host(f"{name}-wan"),
            )
            await link.start()
        return InProcessWorker(instance, link)
