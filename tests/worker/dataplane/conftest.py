"""Real worker processes on loopback, started once for the whole data-plane suite.

Topology: P and RLD in "datacenter A", MD in "B"; every WAN-facing worker has
a WAN link emulator in front of its data port, so P->MD and MD->RLD traffic
crosses an emulated line the tests can throttle or cut. ``mono`` is the
colocated reference. ``md_v`` and ``rld_v`` are victims the fault tests kill
(the other tests never use them, so test order does not matter).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator, Sequence

import httpx
import pytest

from pdd.common.wire import PipelinePlan, SamplingSpec
from pdd.worker.driver import RunResult, run_plan
from pdd.worker.local_cluster import LinkSpec, LocalCluster, WorkerSpec

#: Tiny model: 2 (k, v) * 4 layers * 2 kv heads * 32 head dim * 4 bytes (fp32).
KV_BYTES_PER_TOKEN = 2048
BLOCK_SIZE = 16
TRANSFER_TIMEOUT_S = 5.0

SPECS = [
    WorkerSpec("p", "prefill"),
    WorkerSpec("rld", "relay", wan_facing=True),
    WorkerSpec("md", "main", wan_facing=True),
    WorkerSpec("mono", "mono"),
    WorkerSpec("md_v", "main", wan_facing=True),
    WorkerSpec("rld_v", "relay", wan_facing=True),
]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("dataplane-logs")
    c = LocalCluster.start(
        SPECS,
        logs,
        LinkSpec(gbps=1.0, rtt_ms=4.0, jitter_ms=1.0, partition_grace_s=1.0),
        common_args=[
            "--num-blocks",
            "1024",
            "--block-size",
            str(BLOCK_SIZE),
            "--torch-threads",
            "1",
            "--transfer-timeout-s",
            str(TRANSFER_TIMEOUT_S),
            "--max-running",
            "64",
        ],
    )
    yield c
    c.stop()


class DataPlane:
    """Helpers for the data-plane tests (a fixture: test modules cannot import conftest)."""

    kv_bytes_per_token = KV_BYTES_PER_TOKEN
    block_size = BLOCK_SIZE
    transfer_timeout_s = TRANSFER_TIMEOUT_S

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

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

    async def run_all(
        self, plans: Sequence[PipelinePlan], on_token: Callable | None = None
    ) -> list[RunResult]:
        """Run the plans concurrently (one batch), each through the stream-merging driver."""
        try:
            async with httpx.AsyncClient(timeout=30.0) as client, asyncio.TaskGroup() as group:
                runs = [
                    group.create_task(run_plan(p, client, self.cluster.secret, 120.0, on_token))
                    for p in plans
                ]
        except ExceptionGroup as group_error:
            raise group_error.exceptions[0] from None
        return [run.result() for run in runs]

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

    def assert_quiescent(self) -> None:
        states = self.cluster.wait_quiescent(timeout_s=20.0)
        leaking = {name: s for name, s in states.items() if not s.quiescent}
        assert not leaking, f"request state, locks or blocks leaked: {leaking}"


@pytest.fixture(scope="session")
def dp(cluster: LocalCluster) -> DataPlane:
    return DataPlane(cluster)


def counter(metrics: dict[str, float], name: str) -> float:
    """A counter's value summed over its labels (``name`` without ``_total``)."""
    total = name + "_total"
    return sum(v for k, v in metrics.items() if k == total or k.startswith(total + "{"))


class CounterDelta:
    """Counter values of some workers before/after a block of work."""

    def __init__(self, cluster: LocalCluster, names: Sequence[str]) -> None:
        self.cluster = cluster
        self.before = {n: cluster[n].metrics() for n in names}

    def __call__(self, worker: str, name: str, labels: str = "", gauge: bool = False) -> float:
        now = self.cluster[worker].metrics()
        if gauge:
            return now.get(name, 0.0) - self.before[worker].get(name, 0.0)
        if labels:
            key = f"{name}_total{{{labels}}}"
            return now.get(key, 0.0) - self.before[worker].get(key, 0.0)
        return counter(now, name) - counter(self.before[worker], name)
