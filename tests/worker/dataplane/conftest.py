"""Two data planes behind one set of helpers (``DataPlane``):

- ``dp``: real ``pdd worker`` processes on loopback, started once for the session,
  every WAN-facing worker behind a ``pdd wan-link`` process (integration tier: what a
  pod runs, over real sockets);
- ``vdp``: the same topology in one process on a virtual clock (``inprocess.py``),
  fresh for each test (unit tier: deterministic, whatever the machine's speed).

Topology: P and RLD in "datacenter A", MD in "B"; P->MD and MD->RLD traffic crosses
an emulated WAN line the tests can throttle, hold or cut. ``mono`` is the colocated
reference. ``md_v`` and ``rld_v`` are victims the process fault tests kill, ``rld_d``
the relay the drain test stops with SIGTERM (no other test uses them, so test order
does not matter). Both planes run requests through the
router's own stream relay (``relay_tokens``) and worker client.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest

from pdd.common.wire import PipelinePlan, SamplingSpec, StateReport, TokenEvent
from pdd.local.cluster import LinkSpec, LocalCluster, WorkerSpec
from pdd.router.stream_relay import relay_tokens
from pdd.router.token_stream import TokenStreamMerger
from pdd.router.worker_client import WorkerClient
from pdd.worker.model.loader import LoadedModel
from pdd.worker.roles.base import WorkerSettings

# Loaded by path: with --import-mode=importlib the tests folder is not on sys.path.
_spec = importlib.util.spec_from_file_location(
    "pdd_test_inprocess", Path(__file__).with_name("inprocess.py")
)
inprocess = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = inprocess  # dataclasses look their module up there
_spec.loader.exec_module(inprocess)

#: Tiny model: 2 (k, v) * 4 layers * 2 kv heads * 32 head dim * 4 bytes (fp32).
KV_BYTES_PER_TOKEN = 2048
BLOCK_SIZE = 16
#: In-process (virtual time): cuts and stalls end in 5 s of loop time, costing nothing.
TRANSFER_TIMEOUT_S = 5.0
#: Processes: no process test waits for a timeout to fire (their faults are resets), so the
#: timeout is only a backstop, and long enough that a loaded machine never trips it.
PROCESS_TRANSFER_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 120.0
LINK = LinkSpec(gbps=1.0, rtt_ms=4.0, jitter_ms=1.0, partition_grace_s=1.0)
#: In-process engines' step budget: the tests' 40-140-token prompts prefill in 2-5
#: chunks, so every in-process test has P streaming its KV while it still prefills.
PREFILL_CHUNK_TOKENS = 32
#: The engines' own default budget (512), for bursts: dozens of short prompts sent at
#: once prefill in one or a few steps, so their relays start decoding together. Under
#: ``PREFILL_CHUNK_TOKENS`` P works through such a burst 32 tokens a step, the first
#: relays finish before the last start, and a test that holds MD's KV until every
#: relay streamed a few tokens can hand none of the early ones over.
BURST_CHUNK_TOKENS = None

SPECS = [
    WorkerSpec("p", "prefill"),
    WorkerSpec("rld", "relay", wan_facing=True),
    WorkerSpec("md", "main", wan_facing=True),
    WorkerSpec("mono", "mono"),
    WorkerSpec("md_v", "main", wan_facing=True),
    WorkerSpec("rld_v", "relay", wan_facing=True),
    WorkerSpec("rld_d", "relay", wan_facing=True),
]


class Cluster(Protocol):
    """What the helpers need of either plane's cluster."""

    secret: str

    def __getitem__(self, name: str) -> Any: ...

    def plan(
        self, request_id: str, prompt_ids: list[int], *args: Any, **kw: Any
    ) -> PipelinePlan: ...


@dataclass
class Run:
    """One request as the client saw it, through the router's stream relay."""

    request_id: str
    events: list[TokenEvent]
    duplicates: int  # positions the relay received more than once (an upstream inefficiency)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> list[TokenEvent]:
        """The token events (the last may be followed by a finish event without a token)."""
        return [e for e in self.events if e.is_token]

    @property
    def token_ids(self) -> list[int]:
        return [e.token_id for e in self.tokens]  # type: ignore[misc]

    @property
    def sources(self) -> list[str]:
        return [e.source for e in self.tokens]

    @property
    def finishes(self) -> list[str | None]:
        """The finish reason of every event that ends the stream (one, in a whole run)."""
        return [e.finish_reason for e in self.events if e.finished]


class DataPlane:
    """Helpers for the data-plane tests (a fixture: test modules cannot import conftest)."""

    kv_bytes_per_token = KV_BYTES_PER_TOKEN
    block_size = BLOCK_SIZE

    def __init__(
        self,
        cluster: Cluster,
        client: Callable[[], WorkerClient],
        quiescent: Callable[[], Awaitable[dict[str, StateReport]]],
    ) -> None:
        self.cluster = cluster
        self._client = client
        self._quiescent = quiescent

    @staticmethod
    def prompts(n: int, seed: int, lo: int = 40, hi: int = 140) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]

    @staticmethod
    def sampling(i: int, max_tokens: int) -> SamplingSpec:
        """Even requests greedy, odd ones seeded top-p/top-k sampling."""
        if i % 2 == 0:
            return SamplingSpec(max_tokens=max_tokens, ignore_eos=True)
        return SamplingSpec(
            max_tokens=max_tokens, temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i,
            ignore_eos=True,
        )  # fmt: skip

    @staticmethod
    def steered(i: int, max_tokens: int) -> SamplingSpec:
        """``sampling(i)`` plus a mix of penalties, logit bias, min_tokens, stop ids and
        logprobs that differs by request."""
        mixes: list[dict[str, Any]] = [
            {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logprobs": 3},
            {"repetition_penalty": 1.8, "logit_bias": ((65, 8.0), (66, -100.0)), "logprobs": 0},
            {"presence_penalty": -1.0, "min_tokens": max_tokens * 3 // 4, "stop_token_ids": (7,),
             "logprobs": 5},
        ]  # fmt: skip
        return DataPlane.sampling(i, max_tokens).model_copy(update=mixes[i % 3])

    async def run_all(
        self, plans: Sequence[PipelinePlan], on_token: Callable[[TokenEvent], None] | None = None
    ) -> list[Run]:
        """Run the plans concurrently, each through the router's stream relay.

        ``on_token`` sees each token as the client receives it (tests act on the stream there).
        """
        client = self._client()
        try:
            async with asyncio.TaskGroup() as group:
                runs = [group.create_task(self._run(plan, client, on_token)) for plan in plans]
        except ExceptionGroup as group_error:
            raise group_error.exceptions[0] from None
        finally:
            await client.aclose()
        return [run.result() for run in runs]

    @staticmethod
    async def _run(
        plan: PipelinePlan, client: WorkerClient, on_token: Callable[[TokenEvent], None] | None
    ) -> Run:
        merger = TokenStreamMerger(plan.request_id)
        events = []
        async for event in relay_tokens(plan, client, RUN_TIMEOUT_S, merger):
            events.append(event)
            if on_token is not None:
                on_token(event)
        return Run(plan.request_id, events, merger.duplicates, dict(merger.errors))

    async def reference(self, prompts: Sequence[list[int]], max_tokens: int, tag: str) -> list:
        """Token IDs from the colocated ``mono`` instance, the ground truth."""
        plans = [
            self.cluster.plan(
                f"{tag}-mono-{i}", p, "mono", self.sampling(i, max_tokens), main="mono"
            )
            for i, p in enumerate(prompts)
        ]
        return [r.token_ids for r in await self.run_all(plans)]

    def counters(self, *workers: str) -> CounterDelta:
        return CounterDelta(self.cluster, workers)

    def channels_accepted(self, name: str) -> int:
        """Authenticated channels worker ``name``'s data servers have accepted so far
        (in-process clusters only)."""
        instance = self.cluster[name].instance
        return sum(s.stats.authenticated for s in (instance.data, instance.wan) if s is not None)

    async def assert_quiescent(self) -> None:
        states = await self._quiescent()
        leaking = {name: s for name, s in states.items() if not s.quiescent}
        assert not leaking, f"request state, locks or blocks leaked: {leaking}"


def counter(metrics: dict[str, float], name: str) -> float:
    """A counter's value summed over its labels (``name`` without ``_total``)."""
    total = name + "_total"
    return sum(v for k, v in metrics.items() if k == total or k.startswith(total + "{"))


class CounterDelta:
    """Counter values of some workers before/after a block of work."""

    def __init__(self, cluster: Cluster, names: Sequence[str]) -> None:
        self.cluster = cluster
        self.before = {n: cluster[n].metrics() for n in names}

    def __call__(self, worker: str, name: str, labels: str = "", gauge: bool = False) -> float:
        now = self.cluster[worker].metrics()
        if gauge:  # a gauge, or any one sample (a histogram's _count), as named
            key = f"{name}{{{labels}}}" if labels else name
            return now.get(key, 0.0) - self.before[worker].get(key, 0.0)
        if labels:
            key = f"{name}_total{{{labels}}}"
            return now.get(key, 0.0) - self.before[worker].get(key, 0.0)
        return counter(now, name) - counter(self.before[worker], name)


# --- the process plane (integration) ----------------------------------------------------------
@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("dataplane-logs")
    c = LocalCluster.start(
        SPECS,
        logs,
        LINK,
        common_args=[
            "--num-blocks", "1024", "--block-size", str(BLOCK_SIZE), "--torch-threads", "1",
            "--transfer-timeout-s", str(PROCESS_TRANSFER_TIMEOUT_S), "--max-running-requests", "64",
        ],
    )  # fmt: skip
    yield c
    c.stop()


@pytest.fixture(scope="session")
def dp(cluster: LocalCluster) -> DataPlane:
    return DataPlane(
        cluster,
        lambda: WorkerClient(cluster.secret, timeout_s=30.0),
        lambda: asyncio.to_thread(cluster.wait_quiescent, 60.0),
    )


# --- the in-process plane on a virtual clock (unit) -------------------------------------------
@pytest.fixture
async def vdp(tiny: LoadedModel) -> AsyncIterator[DataPlane]:
    """A fresh in-process cluster; the test must be marked ``virtual_clock``."""
    async for plane in _in_process(tiny, TRANSFER_TIMEOUT_S):
        yield plane


@pytest.fixture
async def vdp_default_timeouts(tiny: LoadedModel) -> AsyncIterator[DataPlane]:
    """``vdp`` with the workers' default timeouts (``--transfer-timeout-s`` 30 s, so a
    10 s connect timeout), for tests about which of them fires first."""
    async for plane in _in_process(tiny, WorkerSettings.transfer_timeout_s):
        yield plane


@pytest.fixture
async def vdp_burst(tiny: LoadedModel) -> AsyncIterator[DataPlane]:
    """``vdp`` with the engines' default step budget (``BURST_CHUNK_TOKENS``: why)."""
    async for plane in _in_process(tiny, TRANSFER_TIMEOUT_S, BURST_CHUNK_TOKENS):
        yield plane


async def _in_process(
    tiny: LoadedModel, transfer_timeout_s: float, step_tokens: int | None = PREFILL_CHUNK_TOKENS
) -> AsyncIterator[DataPlane]:
    cluster = inprocess.InProcessCluster(
        tiny,
        SPECS,
        LINK,
        block_size=BLOCK_SIZE,
        num_blocks=256,  # 4096 tokens per instance: more than any in-process test holds
        transfer_timeout_s=transfer_timeout_s,
        max_num_batched_tokens=step_tokens,
    )
    async with cluster:
        yield DataPlane(cluster, cluster.client, cluster.wait_quiescent)


@asynccontextmanager
async def _coded_data_plane(tiny: LoadedModel, codec: str) -> AsyncIterator[DataPlane]:
    """An in-process cluster whose P and ``md`` run ``--kv-codec codec``, with
    ``md_plain``, a main decode left at none."""
    specs = [
        WorkerSpec("p", "prefill"),
        WorkerSpec("rld", "relay", wan_facing=True),
        WorkerSpec("md", "main", wan_facing=True),
        WorkerSpec("md_plain", "main", wan_facing=True),
        WorkerSpec("mono", "mono"),
    ]
    cluster = inprocess.InProcessCluster(
        tiny,
        specs,
        LINK,
        block_size=BLOCK_SIZE,
        num_blocks=256,
        transfer_timeout_s=TRANSFER_TIMEOUT_S,
        kv_codecs={"p": codec, "md": codec},
        max_num_batched_tokens=PREFILL_CHUNK_TOKENS,
    )
    async with cluster:
        yield DataPlane(cluster, cluster.client, cluster.wait_quiescent)


@pytest.fixture
async def cvdp(tiny: LoadedModel) -> AsyncIterator[DataPlane]:
    """P and ``md`` code the WAN's KV int8, ``md_plain`` stays at none; virtual clock."""
    async with _coded_data_plane(tiny, "int8") as dp:
        yield dp


@pytest.fixture
async def avdp(tiny: LoadedModel) -> AsyncIterator[DataPlane]:
    """Under ``--kv-codec adaptive``: P and ``md`` take whatever codec a plan names (none,
    int8, int4), ``md_plain`` stays at none; virtual clock."""
    async with _coded_data_plane(tiny, "adaptive") as dp:
        yield dp
