"""Router overhead: the same requests through ``pdd router`` and straight to the workers.

    python bench/router.py [--requests 64] [--concurrency 4] [--max-tokens 16]
                           [--prompt-tokens 200] [--pipeline P-MD|mono] [--json OUT]
                           [--instances 10 100 1000] [--decision-only]
    python bench/router.py --stub-workers 64 [--router-replicas 1 2 4] [--rates 100 200 ..]
                           [--duration 5] [--long-tokens 256] [--json OUT]

Starts real ``pdd worker`` processes (the tiny model) and one ``pdd router`` on
loopback. Each request runs twice at a fixed concurrency: once through the router
(``/v1/completions``, non-streaming: tokenize, decide, proxy, merge, detokenize), and
once driving the workers directly with the router's own stream relay (``relay_tokens``,
on the same plan the router would build). Reported: p50/p99 latency of both, their
ratio, the added milliseconds, and the decision cost measured in-process on fleets of
each ``--instances`` size, side by side (``--decision-only`` skips the workers and
prints just that table), twice: the policy alone (prefix lookup + ``policy.decide`` +
the fleet updates of the request's in-flight counts) and the router's whole
``Dispatcher.route`` (the registry's ready instances, the store's in-flight counts,
the prefix lookup, the policy), while polls keep bringing new load reports.

``--stub-workers N`` measures the router itself instead, in front of N stub workers
(``stub_worker.py``: the worker API, fake tokens, no model; ``stub_worker_load.py``):
routed requests per second (plain and streaming) open-loop up to saturation, the router
processes' CPU per request and per streamed token, the TTFT the router adds, its memory
per open stream; ``--router-replicas 1 2 4`` repeats the plain ramp with that many
router processes sharing a Redis of their own, with the prefix-hit rate and load spread
the stubs saw, side by side (docs/router-scale.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE, block_hashes
from pdd.common.cache_events import BlockStored
from pdd.common.cost_model import LinkState
from pdd.common.link_estimator import LinkEstimator
from pdd.common.vocabulary import Role
from pdd.common.wire import Endpoint, LoadReport, SamplingSpec
from pdd.local.cluster import LocalCluster, WorkerSpec, free_port
from pdd.router.config import RouterConfig, WorkerRef
from pdd.router.dispatcher import Dispatcher
from pdd.router.fleet import Fleet
from pdd.router.instance_choice import InstanceLoad
from pdd.router.link_health import LinkHealth
from pdd.router.link_view import LinkView
from pdd.router.policy import Decision, PolicyConfig, RequestFeatures, decide
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig
from pdd.router.recent_traffic import RecentTraffic, TrafficWindow
from pdd.router.registry import Instance, InstanceRegistry
from pdd.router.state.memory import LocalStore
from pdd.router.stream_relay import relay_tokens
from pdd.router.worker_client import WorkerClient
from pdd.simulator.stats import percentile

sys.path.insert(0, str(Path(__file__).parent))  # bench/ scripts import each other
import stub_worker_load


def summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": percentile(values, 50) * 1e3, "p99_ms": percentile(values, 99) * 1e3}


async def run_at_concurrency(
    n: int, concurrency: int, one: Callable[[int], Awaitable[None]]
) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def task(i: int) -> None:
        async with sem:
            start = time.perf_counter()
            await one(i)
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(task(i) for i in range(n)))
    return latencies


def prompt(i: int, tokens: int) -> str:
    """Distinct prompts (no cross-request cache hits) of ``tokens`` byte tokens."""
    return (f"request {i:05d} " + "lorem ipsum dolor sit amet " * tokens)[:tokens]


async def bench_router(url: str, args: argparse.Namespace) -> list[float]:
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(i: int) -> None:
            body = {
                "model": "tiny",
                "prompt": prompt(i, args.prompt_tokens),
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            resp = await client.post(f"{url}/v1/completions", json=body)
            resp.raise_for_status()

        return await run_at_concurrency(args.requests, args.concurrency, one)


async def bench_direct(cluster: LocalCluster, args: argparse.Namespace) -> list[float]:
    sampling = SamplingSpec(max_tokens=args.max_tokens, ignore_eos=True)
    client = WorkerClient(cluster.secret, timeout_s=120.0)

    async def one(i: int) -> None:
        ids = list(prompt(10_000 + i, args.prompt_tokens).encode())
        if args.pipeline == "mono":
            plan = cluster.plan(f"d{i}", ids, "mono", sampling, main="m")
        else:
            plan = cluster.plan(f"d{i}", ids, "P-MD", sampling, main="md")
        async for _ in relay_tokens(plan, client, 120.0):
            pass

    try:
        return await run_at_concurrency(args.requests, args.concurrency, one)
    finally:
        await client.aclose()


#: The published PDD pools' shares (39 P, 4 RLD, 32 MD) for a fleet of any size.
ROLE_SHARES = ((Role.PREFILL, 39 / 75), (Role.RELAY, 4 / 75), (Role.MAIN, 32 / 75))
CAPACITY = 16


def decision_fleet(n: int, rng: random.Random) -> Fleet:
    """``n`` instances in the published shares (at least one per role), randomly half busy."""
    loads = []
    for role, share in ROLE_SHARES:
        for k in range(max(1, round(n * share))):
            loads.append(InstanceLoad(f"{role}{k}", role, rng.randrange(CAPACITY), CAPACITY))
    return Fleet.of(loads)


def bench_decision(
    instances: int, prompt_tokens: int, iterations: int = 4000, conversations: int = 400
) -> dict[str, float]:
    """The router's per-request decision alone on a fleet of ``instances``: block hashes,
    index lookup, policy, and the in-flight count it adds (then, outside the timer, the
    count an earlier request releases, so the load stays put). 90% of requests continue
    a conversation one P and one MD hold; the rest are new (the affinity ring's path)."""
    rng = random.Random(instances)
    fleet = decision_fleet(instances, rng)
    index = PrefixIndex(PrefixIndexConfig(block_size=DEFAULT_BLOCK_SIZE))
    prompts = []
    for c in range(conversations):
        ids = [c, *range(prompt_tokens - 1)]
        hashes = block_hashes(ids, DEFAULT_BLOCK_SIZE)
        for role in (Role.PREFILL, Role.MAIN):
            holder = rng.choice(list(fleet.role(role).ids()))
            index.apply(
                holder,
                BlockStored(block_hashes=hashes, parent_hash=None, block_size=DEFAULT_BLOCK_SIZE),
            )
        prompts.append(ids)
    policy = PolicyConfig(kv_bytes_per_token=2048)
    link, traffic = LinkState(10.0, 20.0), TrafficWindow(60.0)
    times, leased = [], []
    for i in range(iterations):
        ids = rng.choice(prompts) if rng.random() < 0.9 else [10**6 + i, *range(prompt_tokens)]
        start = time.process_time()  # CPU time: other processes on the machine don't count
        hits = index.match(index.hashes(ids))
        features = RequestFeatures.from_prompt(ids, 64, DEFAULT_BLOCK_SIZE)
        decision = decide(features, hits, fleet, LinkView(link), traffic, policy)
        if isinstance(decision, Decision):
            a = decision.instances
            chosen = [x for x in (a.prefill, a.relay, a.main_decode) if x is not None]
            for x in chosen:
                add_active(fleet, x, +1)
            leased.append(chosen)
        times.append(time.process_time() - start)
        if len(leased) > instances // 2:
            for x in leased.pop(0):
                add_active(fleet, x, -1)
    return {"p50_us": percentile(times, 50) * 1e6, "p99_us": percentile(times, 99) * 1e6}


def add_active(fleet: Fleet, instance_id: str, delta: int) -> None:
    for role, _ in ROLE_SHARES:
        load = fleet.role(role).get(instance_id)
        if load is not None:
            fleet.update(InstanceLoad(instance_id, role, load.active + delta, load.capacity))


#: Requests per second the whole-route bench assumes between two polls of every
#: instance (every 0.5 s): each request sees this share of the fleet's reports change.
ROUTE_RATE = 200
POLL_S = 0.5


def route_fleet(n: int, rng: random.Random) -> tuple[InstanceRegistry, LocalStore, PrefixIndex]:
    """A registry whose ``n`` instances (published shares) all answered a poll."""
    store = LocalStore(ttl_s=600.0)
    index = PrefixIndex(PrefixIndexConfig(block_size=DEFAULT_BLOCK_SIZE), store=store.index)
    registry = InstanceRegistry((), WorkerClient("bench"), index, POLL_S)
    for role, share in ROLE_SHARES:
        for k in range(max(1, round(n * share))):
            name = f"{role}{k}"
            inst = Instance(role, f"http://{name}:8000", name)
            inst.endpoint = Endpoint(
                instance_id=name, http_url=inst.http_url, fast_addr="x:1", wan_addr="x:2"
            )
            inst.load = load_report(name, role, rng.randrange(CAPACITY))
            registry._instances[inst.http_url] = inst
            registry._mark_ready(inst)  # what a good poll concludes
    return registry, store, index


def load_report(name: str, role: Role, running: int) -> LoadReport:
    return LoadReport(
        instance_id=name, role=role, running=running, waiting=0, kv_blocks_free=1,
        kv_blocks_total=2, relay_load=0.0, capacity=CAPACITY,
    )  # fmt: skip


async def bench_route(
    instances: int, prompt_tokens: int, iterations: int = 4000, conversations: int = 400
) -> dict[str, float]:
    """The router's whole ``Dispatcher.route`` on a fleet of ``instances``, same traffic
    as :func:`bench_decision`; the request's leases are counted in the store as the
    router does. Between requests (outside the timer) polls bring new load reports for
    ``instances / (ROUTE_RATE x POLL_S)`` instances, as they would at that rate."""
    rng = random.Random(instances)
    registry, store, index = route_fleet(instances, rng)
    every = registry.all()
    prompts = []
    for c in range(conversations):
        ids = [c, *range(prompt_tokens - 1)]
        hashes = block_hashes(ids, DEFAULT_BLOCK_SIZE)
        for role in (Role.PREFILL, Role.MAIN):
            holder = rng.choice([i for i in every if i.role == role]).instance_id
            index.apply(
                holder,
                BlockStored(block_hashes=hashes, parent_hash=None, block_size=DEFAULT_BLOCK_SIZE),
            )
        prompts.append(ids)
    refs = (WorkerRef(Role.PREFILL, "http://p"), WorkerRef(Role.MAIN, "http://md"))
    config = RouterConfig(workers=refs, secret="bench", link_gbps=10.0, link_rtt_ms=20.0)
    policy = PolicyConfig(kv_bytes_per_token=2048)
    health = LinkHealth("wan")
    estimator = LinkEstimator(config.link, config.prefill_tokens_per_s)
    dispatcher = Dispatcher(
        config, registry, index, store, policy, RecentTraffic(), health, estimator
    )
    polled = max(1, round(instances / (ROUTE_RATE * POLL_S)))
    times, leased = [], []
    for i in range(iterations):
        for inst in rng.sample(every, min(polled, len(every))):
            inst.load = load_report(inst.instance_id, inst.role, rng.randrange(CAPACITY))
            registry._mark_ready(inst)
        ids = rng.choice(prompts) if rng.random() < 0.9 else [10**6 + i, *range(prompt_tokens)]
        start = time.process_time()
        route = await dispatcher.route(ids, 64)
        for key in route.lease_keys:
            store.add_inflight(key, +1)
        times.append(time.process_time() - start)
        leased.append(route.lease_keys)
        if len(leased) > instances // 2:
            for key in leased.pop(0):
                store.add_inflight(key, -1)
    return {"p50_us": percentile(times, 50) * 1e6, "p99_us": percentile(times, 99) * 1e6}


def decision_table(sizes: list[int], prompt_tokens: int) -> dict[str, dict[str, dict[str, float]]]:
    bench_decision(sizes[0], prompt_tokens, iterations=500)  # warm-up: imports, allocator
    asyncio.run(bench_route(sizes[0], prompt_tokens, iterations=500))
    table = {
        str(n): {
            "policy": bench_decision(n, prompt_tokens),
            "route": asyncio.run(bench_route(n, prompt_tokens)),
        }
        for n in sizes
    }
    print(f"{'instances':>10}  {'policy p50/p99 us':>18}  {'route p50/p99 us':>18}")
    for n, row in table.items():
        pol, rou = row["policy"], row["route"]
        print(
            f"{n:>10}  {pol['p50_us']:>8.1f} {pol['p99_us']:>9.1f}  "
            f"{rou['p50_us']:>8.1f} {rou['p99_us']:>9.1f}"
        )
    return table


def start_router(
    cluster: LocalCluster, args: argparse.Namespace, log: Path
) -> tuple[str, subprocess.Popen]:
    port = free_port()
    if args.pipeline == "mono":
        workers = ["--mono", f"m={cluster['m'].url}"]
    else:
        workers = ["--prefill", f"p={cluster['p'].url}", "--main", f"md={cluster['md'].url}"]
    argv = [sys.executable, "-m", "pdd.cli", "router", "--model", "tiny", "--host", "127.0.0.1",
            "--port", str(port), *workers]  # fmt: skip
    env = {**os.environ, "PDD_SHARED_SECRET": cluster.secret}
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/ready").status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"router did not become ready; see {log}")
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--pipeline", choices=("P-MD", "mono"), default="P-MD")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--instances", type=int, nargs="+", default=[10, 100, 1000],
                   help="fleet sizes for the decision cost")  # fmt: skip
    p.add_argument("--decision-only", action="store_true", help="no workers, no router")
    add_stub_flags(p)
    args = p.parse_args()
    if args.stub_workers is not None:
        return stub_bench(args)
    if args.decision_only:
        result = {"decision": decision_table(args.instances, args.prompt_tokens)}
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    logs = Path(tempfile.mkdtemp(prefix="pdd-bench-router-"))
    specs = ([WorkerSpec("m", "mono")] if args.pipeline == "mono"
             else [WorkerSpec("p", "prefill"), WorkerSpec("md", "main")])  # fmt: skip
    common = ["--model", "tiny", "--num-blocks", "1024", "--torch-threads", "1"]
    cluster = LocalCluster.start(specs, logs, common_args=common)
    router = None
    try:
        url, router = start_router(cluster, args, logs / "router.log")
        asyncio.run(bench_router(url, args))  # warm-up: connections, allocator, caches
        via_router = asyncio.run(bench_router(url, args))
        direct = asyncio.run(bench_direct(cluster, args))
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        cluster.stop()
    r, d = summary(via_router), summary(direct)
    result = {
        "config": vars(args) | {"json": str(args.json) if args.json else None},
        "router": r,
        "direct": d,
        "ratio_p50": r["p50_ms"] / d["p50_ms"],
        "ratio_p99": r["p99_ms"] / d["p99_ms"],
        "overhead_p50_ms": r["p50_ms"] - d["p50_ms"],
        "overhead_mean_ms": (statistics.mean(via_router) - statistics.mean(direct)) * 1e3,
        "decision": decision_table(args.instances, args.prompt_tokens),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def add_stub_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the router in front of stub workers")
    g.add_argument("--stub-workers", type=int, metavar="N", help="N stub workers, no model")
    g.add_argument("--router-replicas", type=int, nargs="+", default=[1], metavar="R",
                   help="router processes sharing Redis (one run per count)")  # fmt: skip
    g.add_argument("--rates", type=float, nargs="+", default=[100, 200, 400, 800, 1600],
                   help="offered requests/s, rising, until the routers fall behind")  # fmt: skip
    g.add_argument("--duration", type=float, default=5.0, help="seconds per rate")
    g.add_argument("--long-tokens", type=int, default=256, help="tokens of the long streams")
    g.add_argument("--token-phase-rps", type=float, default=20.0,
                   help="requests/s of the short and long streams (per-token cost)")  # fmt: skip
    g.add_argument("--token-rate", type=float, default=1000.0, help="stub tokens/s per stream")
    g.add_argument("--ttft-requests", type=int, default=200)
    g.add_argument("--open-streams", type=int, default=256, help="streams held for memory")
    g.add_argument("--max-inflight", type=int, default=512, help="the generator's cap")
    g.add_argument("--poll-interval-s", type=float,
                   help="the routers' worker poll interval (default: theirs, 0.5 s)")  # fmt: skip
    g.add_argument("--idle-seconds", type=float, default=5.0,
                   help="routers at rest, measuring what their polls cost")  # fmt: skip


def stub_bench(args: argparse.Namespace) -> int:
    bad = [n for n in ("stub_workers", "duration", "long_tokens", "token_phase_rps",
                       "token_rate", "ttft_requests", "open_streams", "max_inflight",
                       "idle_seconds")
           if getattr(args, n) <= 0]  # fmt: skip
    if bad or min(args.rates) <= 0 or min(args.router_replicas) < 1:
        named = ", ".join(bad) or "--rates, --router-replicas"
        sys.exit(f"bench/router.py: these need positive values: {named}")
    if args.long_tokens <= args.max_tokens:
        sys.exit("bench/router.py: --long-tokens must exceed --max-tokens")
    bench = stub_worker_load.BenchArgs(
        stub_workers=args.stub_workers, pipeline=args.pipeline, replicas=args.router_replicas,
        rates=sorted(args.rates), duration_s=args.duration, max_tokens=args.max_tokens,
        long_tokens=args.long_tokens, token_phase_rps=args.token_phase_rps,
        token_rate=args.token_rate, ttft_requests=args.ttft_requests,
        open_streams=args.open_streams, max_inflight=args.max_inflight,
        idle_s=args.idle_seconds, poll_interval_s=args.poll_interval_s,
    )  # fmt: skip
    result = stub_worker_load.run(bench)
    print(stub_worker_load.table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
