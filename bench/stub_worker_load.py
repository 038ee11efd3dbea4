"""The router under load from stub workers: ``bench/router.py --stub-workers N``.

Starts N stub workers (``stub_worker.py``: the worker API, fake tokens, no model), one or
more real ``pdd router`` processes in front of them (several share a ``redis-server`` of
their own, as replicas share Redis in production), and drives the routers open-loop: a
request leaves at its scheduled time whatever the earlier ones are doing, at rising offered
rates until the routers fall behind. The router processes' CPU time (user + system, from
``/proc`` through psutil), not wall time, gives the cost per request and per streamed token,
so the load generator and the stubs, which share the machine, do not count in them.

Requests are turns of conversations: a turn's prompt is the conversation's previous prompt
and more, so a router that sends a conversation back to the instance holding it gets a
prefix hit. The stubs count what they held of each prompt (``/stub/stats``): that, and how
evenly the requests fell on the instances, is the routing's quality beside its speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from pdd.common.vocabulary import Pipeline, Role
from pdd.common.wire import Endpoint, PipelinePlan, SamplingSpec
from pdd.local.cluster import free_port
from pdd.local.manifests import find_program
from pdd.router.stream_relay import relay_tokens
from pdd.router.worker_client import WorkerClient
from pdd.simulator.stats import percentile

SECRET = "bench-stub"
HERE = Path(__file__).parent
#: A step whose routers completed less than this share of the offered requests (or that
#: had to drop some, or saw any fail) is past saturation.
KEEPS_UP = 0.9


# -- the workload -------------------------------------------------------------------------


@dataclass
class Conversations:
    """Turns of ``count`` conversations, drawn at random: turn t's prompt is turn t-1's
    plus ``turn_chars`` characters (the tiny model's tokenizer: one token per byte), and a
    conversation starts over, as a new one, after ``max_turns`` turns."""

    count: int = 64
    first_chars: int = 200
    turn_chars: int = 32
    max_turns: int = 8
    seed: int = 0
    _turns: dict[int, int] = field(default_factory=dict)
    _generation: dict[int, int] = field(default_factory=dict)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def next_prompt(self) -> str:
        c = self._rng.randrange(self.count)
        turn = self._turns.get(c, 0)
        if turn == self.max_turns:
            turn, self._generation[c] = 0, self._generation.get(c, 0) + 1
        self._turns[c] = turn + 1
        # the conversation's name first: its first block is its own, shared with no other
        head = f"{c:05d}.{self._generation.get(c, 0):04d} conversation: "
        body = "lorem ipsum dolor sit amet consectetur " * (
            1 + self.max_turns * self.turn_chars // 39
        )
        return (head + body)[: self.first_chars + turn * self.turn_chars]


def ideal_hit_rate(prompts: list[str], block_size: int, counted_from: int = 0) -> float:
    """The prompt-token share a perfect router hits on ``prompts[counted_from:]``: each
    prompt's full blocks that an earlier prompt of its conversation already covered (the
    earlier prompts, a warm-up's, count as held, not as requests)."""
    seen: dict[str, int] = {}
    hit = total = 0
    for k, p in enumerate(prompts):
        key = p[: p.index(":")]
        if k >= counted_from:
            hit += min(seen.get(key, 0), len(p)) // block_size * block_size
            total += len(p)
        seen[key] = max(seen.get(key, 0), len(p))
    return hit / total if total else 0.0


# -- the arithmetic -----------------------------------------------------------------------


@dataclass
class StepResult:
    """One open-loop run at ``offered_rps`` for ``wall_s`` seconds."""

    offered_rps: float
    stream: bool
    max_tokens: int
    wall_s: float
    sent: int = 0
    ok: int = 0
    failed: int = 0
    dropped: int = 0
    router_cpu_s: float = 0.0
    #: The routers' CPU at rest over the same time: their poll of every worker, which
    #: costs the same with no requests (``idle_cores``); the requests' cost is the rest.
    idle_cpu_s: float = 0.0
    tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def request_cpu_s(self) -> float:
        """The routers' CPU the requests cost: all of it less what polling costs."""
        return max(0.0, self.router_cpu_s - self.idle_cpu_s)

    @property
    def achieved_rps(self) -> float:
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def keeps_up(self) -> bool:
        return (
            self.failed == 0
            and self.dropped == 0
            and self.ok >= KEEPS_UP * self.offered_rps * self.wall_s
        )

    def summary(self) -> dict:
        lat = self.latencies_s or [0.0]
        return {
            "offered_rps": self.offered_rps,
            "achieved_rps": round(self.achieved_rps, 1),
            "sent": self.sent,
            "ok": self.ok,
            "failed": self.failed,
            "dropped": self.dropped,
            "router_cpu_s": round(self.router_cpu_s, 3),
            "router_cores_busy": round(self.router_cpu_s / self.wall_s, 3) if self.wall_s else 0.0,
            "idle_cpu_s": round(self.idle_cpu_s, 3),
            "cpu_us_per_request": round(cpu_us_per(self.request_cpu_s, self.ok), 1),
            "cpu_us_per_request_with_polls": round(cpu_us_per(self.router_cpu_s, self.ok), 1),
            "latency_p50_ms": round(percentile(lat, 50) * 1e3, 2),
            "latency_p99_ms": round(percentile(lat, 99) * 1e3, 2),
            "errors": self.errors[:5],
        }


def cpu_us_per(cpu_s: float, count: int) -> float:
    """CPU microseconds per item; NaN where nothing was counted (no figure, not zero)."""
    return cpu_s * 1e6 / count if count else math.nan


def per_core_rate(ok: int, cpu_s: float) -> float:
    """Requests per CPU-second of the routers: what one router core routes when busy."""
    return ok / cpu_s if cpu_s > 0 else math.nan


def streamed_token_cost(short: StepResult, long: StepResult) -> float:
    """CPU microseconds per streamed token: the per-request cost's growth from the short
    streams to the long ones, over the extra tokens (the per-request part cancels)."""
    extra = long.max_tokens - short.max_tokens
    if extra <= 0:
        raise ValueError("the long streams must carry more tokens than the short ones")
    return (
        cpu_us_per(long.request_cpu_s, long.ok) - cpu_us_per(short.request_cpu_s, short.ok)
    ) / extra


def busiest(steps: list[StepResult]) -> StepResult:
    """The step that completed the most requests per second (the routers' ceiling)."""
    return max(steps, key=lambda s: s.achieved_rps)


def spread(counts: list[int]) -> dict[str, float]:
    """How evenly requests fell on instances: max over mean (1 = even) and the
    coefficient of variation."""
    if not counts or sum(counts) == 0:
        return {"max_over_mean": math.nan, "cv": math.nan}
    mean = statistics.mean(counts)
    return {
        "max_over_mean": round(max(counts) / mean, 3),
        "cv": round(statistics.pstdev(counts) / mean, 3),
    }


def decision_quality(
    before: dict[str, dict], after: dict[str, dict], roles: dict[str, str]
) -> dict:
    """Per role, from two ``/stub/stats`` readings by instance: prefix-hit rate (hit
    prompt tokens over prompt tokens) and the spread of requests over instances."""
    out: dict[str, dict] = {}
    for role in sorted(set(roles.values())):
        ids = [i for i, r in roles.items() if r == role]
        delta = {i: {k: after[i][k] - before[i].get(k, 0) for k in after[i]} for i in ids}
        prompt = sum(d["prompt_tokens"] for d in delta.values())
        hit = sum(d["hit_tokens"] for d in delta.values())
        out[role] = {
            "requests": sum(d["requests"] for d in delta.values()),
            "prefix_hit_rate": round(hit / prompt, 4) if prompt else math.nan,
            "load_spread": spread([d["requests"] for d in delta.values()]),
        }
    return out


# -- the processes ------------------------------------------------------------------------


@dataclass
class Stubs:
    """Stub worker processes and their instances (id -> URL, id -> role)."""

    procs: list[subprocess.Popen]
    urls: dict[str, str]
    roles: dict[str, str]

    def endpoint(self, instance_id: str) -> Endpoint:
        url = self.urls[instance_id]
        addr = url.removeprefix("http://")
        return Endpoint(instance_id=instance_id, http_url=url, fast_addr=addr, wan_addr=addr)

    def stats(self) -> dict[str, dict]:
        return {i: httpx.get(f"{u}/stub/stats", timeout=30).json() for i, u in self.urls.items()}

    def live_requests(self, role: str) -> int:
        urls = [self.urls[i] for i, r in self.roles.items() if r == role]
        return sum(httpx.get(f"{u}/load", timeout=30).json()["running"] for u in urls)


def stub_roles(pipeline: str, n: int) -> list[tuple[Role, int]]:
    """How ``n`` stub instances split into roles: all mono, or P and MD half and half."""
    if pipeline == "mono":
        return [(Role.MONO, n)]
    if n < 2:
        raise ValueError("P-MD needs at least 2 stub workers (a P and an MD)")
    return [(Role.PREFILL, n // 2), (Role.MAIN, n - n // 2)]


def start_stubs(pipeline: str, n: int, token_rate: float, logs: Path) -> Stubs:
    stubs = Stubs([], {}, {})
    try:
        for role, count in stub_roles(pipeline, n):
            ports = logs / f"stub-{role}.json"
            ports.unlink(missing_ok=True)  # a file from an earlier run names dead ports
            argv = [
                sys.executable,
                str(HERE / "stub_worker.py"),
                "--role",
                role,
                "--count",
                str(count),
                "--secret",
                SECRET,
                "--token-rate",
                str(token_rate),
                "--ports-file",
                str(ports),
            ]
            log = (logs / f"stub-{role}.log").open("wb")
            stubs.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
            urls = wait_for(
                lambda p=ports: p.exists() and json.loads(p.read_text()), stubs.procs[-1], ports
            )
            stubs.urls.update(urls)
            stubs.roles.update({i: str(role) for i in urls})
    except BaseException:
        stop(stubs.procs)
        raise
    return stubs


def wait_for(
    condition: Callable[[], object], proc: subprocess.Popen, what: object, timeout_s: float = 120
):
    """``condition``'s value once truthy; fails at once if ``proc`` died (a lower bound on
    time only: a slow machine waits longer, nothing decides by speed)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s}s")
        time.sleep(0.05)
    return value


def start_redis(logs: Path) -> tuple[subprocess.Popen, str]:
    program = find_program("redis-server")
    if program is None:
        raise RuntimeError(
            "redis-server is neither on the PATH nor in the venv (./scripts/setup.sh)"
        )
    port = free_port()
    argv = [program, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, stdout=(logs / "redis.log").open("wb"), stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"

    def pings() -> bool:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), 1) as s,
        ):
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
        return False

    wait_for(pings, proc, "redis-server answering")
    return proc, url


def start_routers(
    stubs: Stubs,
    pipeline: str,
    replicas: int,
    redis_url: str | None,
    logs: Path,
    poll_interval_s: float | None = None,
) -> list[tuple[str, subprocess.Popen]]:
    flags = {"mono": "--mono", "prefill": "--prefill", "main": "--main"}
    workers = [a for i, r in stubs.roles.items() for a in (flags[r], f"{i}={stubs.urls[i]}")]
    routers: list[tuple[str, subprocess.Popen]] = []
    try:
        for k in range(replicas):
            port = free_port()
            argv = [
                sys.executable,
                "-m",
                "pdd.cli",
                "router",
                "--model",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--replica-id",
                f"bench-{k}",
                *workers,
            ]
            if redis_url is not None:
                argv += ["--redis", redis_url]
            if poll_interval_s is not None:
                argv += ["--poll-interval-s", str(poll_interval_s)]
            env = {**os.environ, "PDD_SHARED_SECRET": SECRET}
            log = (logs / f"router-{k}.log").open("wb")
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            url = f"http://127.0.0.1:{port}"
            routers.append((url, proc))
            wait_for(lambda u=url: _ready(u), proc, f"router {k} ready (see {logs})")
    except BaseException:
        stop([p for _, p in routers])
        raise
    return routers


def _ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    return False


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop the processes this bench started (by their own handles), then reap them."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """User + system CPU time the router processes have used so far."""
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


# -- the load -----------------------------------------------------------------------------


@dataclass
class Load:
    """What the generator sends: to which routers, how, and the workload."""

    router_urls: list[str]
    conversations: Conversations
    max_inflight: int = 512
    sent_prompts: list[str] = field(default_factory=list)

    def body(self, stream: bool, max_tokens: int) -> dict:
        prompt = self.conversations.next_prompt()
        self.sent_prompts.append(prompt)
        return {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, float | None]:
    """Send one completion; returns (tokens, seconds to the first token or None)."""
    start = time.perf_counter()
    if not body["stream"]:
        resp = await client.post(f"{url}/v1/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {resp.text[:200]}")
        return resp.json()["usage"]["completion_tokens"], None
    first: float | None = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                if first is None:
                    first = time.perf_counter() - start
                tokens += 1
    return tokens, first


async def open_loop(
    load: Load,
    rate: float,
    duration_s: float,
    stream: bool,
    max_tokens: int,
    cpu: Callable[[], float],
    idle_cores: float = 0.0,
) -> StepResult:
    """Send ``rate`` requests per second for ``duration_s``, each at its scheduled time,
    round-robin over the routers; a request that would exceed ``max_inflight`` is dropped
    (counted), so an overloaded router is seen, not waited for."""
    n = max(1, round(rate * duration_s))
    step = StepResult(rate, stream, max_tokens, wall_s=0.0)
    limits = httpx.Limits(
        max_connections=load.max_inflight, max_keepalive_connections=load.max_inflight
    )
    inflight: set[asyncio.Task] = set()
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(i: int, body: dict) -> None:
            start = time.perf_counter()
            try:
                tokens, _ = await one_request(
                    client, load.router_urls[i % len(load.router_urls)], body
                )
            except Exception as exc:  # a failed request is a figure of the step, not a crash
                step.failed += 1
                step.errors.append(repr(exc)[:200])
                return
            step.ok += 1
            step.tokens += tokens
            step.latencies_s.append(time.perf_counter() - start)

        cpu0, t0 = cpu(), time.perf_counter()
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            step.sent += 1
            if len(inflight) >= load.max_inflight:
                step.dropped += 1
                continue
            task = asyncio.create_task(one(i, load.body(stream, max_tokens)))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        await asyncio.gather(*inflight)
        step.wall_s = time.perf_counter() - t0
        step.router_cpu_s = cpu() - cpu0
        step.idle_cpu_s = idle_cores * step.wall_s
    return step


async def idle_cores(cpu: Callable[[], float], seconds: float) -> float:
    """The routers' CPU per second with no requests: the poll loop over every worker."""
    cpu0, t0 = cpu(), time.perf_counter()
    await asyncio.sleep(seconds)
    return (cpu() - cpu0) / (time.perf_counter() - t0)


async def ramp(
    load: Load,
    rates: list[float],
    duration_s: float,
    stream: bool,
    max_tokens: int,
    cpu: Callable[[], float],
    idle: float = 0.0,
) -> list[StepResult]:
    """Open-loop steps at rising rates, up to the first the routers did not keep up with."""
    steps = []
    for rate in rates:
        step = await open_loop(load, rate, duration_s, stream, max_tokens, cpu, idle)
        steps.append(step)
        kind = "stream" if stream else "plain"
        print(f"  {kind:6} {rate:7.0f}/s offered: {json.dumps(step.summary())}", flush=True)
        if not step.keeps_up:
            break
    return steps


async def ttft(load: Load, stubs: Stubs, pipeline: str, requests: int, max_tokens: int) -> dict:
    """Time to the first token, one request at a time: through the router (SSE) and
    straight to the stubs with the router's own client and stream relay."""
    via: list[float] = []
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(requests):
            _, first = await one_request(client, load.router_urls[0], load.body(True, max_tokens))
            assert first is not None, "a stream without a token"
            via.append(first)
    direct: list[float] = []
    worker = WorkerClient(SECRET, timeout_s=120.0)
    try:
        for k in range(requests):
            plan = direct_plan(
                stubs, pipeline, f"direct-{k}", load.conversations.next_prompt(), max_tokens, k
            )
            start = time.perf_counter()
            first_at = None
            async for _ in relay_tokens(plan, worker, 120.0):
                if first_at is None:
                    first_at = time.perf_counter() - start
            assert first_at is not None
            direct.append(first_at)
    finally:
        await worker.aclose()
    row = {}
    for q in (50, 99):
        r, d = percentile(via, q) * 1e3, percentile(direct, q) * 1e3
        row[f"p{q}"] = {
            "router_ms": round(r, 3),
            "direct_ms": round(d, 3),
            "added_ms": round(r - d, 3),
        }
    return row


def direct_plan(
    stubs: Stubs, pipeline: str, rid: str, prompt: str, max_tokens: int, k: int
) -> PipelinePlan:
    """The plan the router would send, built by hand (round-robin over the instances)."""
    by_role: dict[str, list[str]] = {}
    for i, r in sorted(stubs.roles.items()):
        by_role.setdefault(r, []).append(i)
    sampling = SamplingSpec(max_tokens=max_tokens, ignore_eos=True)
    ids = list(prompt.encode())
    if pipeline == "mono":
        main = by_role["mono"][k % len(by_role["mono"])]
        return PipelinePlan(
            request_id=rid,
            prompt_ids=ids,
            sampling=sampling,
            pipeline=Pipeline.MONO,
            main=stubs.endpoint(main),
        )
    p, md = (
        by_role["prefill"][k % len(by_role["prefill"])],
        by_role["main"][k % len(by_role["main"])],
    )
    return PipelinePlan(
        request_id=rid,
        prompt_ids=ids,
        sampling=sampling,
        pipeline=Pipeline.P_MD,
        prefill=stubs.endpoint(p),
        main=stubs.endpoint(md),
    )


async def stream_memory(
    load: Load, stubs: Stubs, decode_role: str, router: psutil.Process, streams: int
) -> dict:
    """Router RSS per open stream: ``streams`` streams whose client reads nothing (the
    router holds its buffer's worth of each, the worst case), against the RSS at rest."""
    url = load.router_urls[0].removeprefix("http://")
    host, port = url.split(":")
    rest = router.memory_info().rss
    base = stubs.live_requests(decode_role)
    writers = []
    try:
        for _ in range(streams):
            body = json.dumps(load.body(True, 100_000)).encode()
            _, writer = await asyncio.open_connection(host, int(port))
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {url}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            writer.write(head + body)
            writers.append(writer)
        deadline = time.monotonic() + 120
        while stubs.live_requests(decode_role) - base < streams and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        opened = stubs.live_requests(decode_role) - base
        held = router.memory_info().rss
    finally:
        for w in writers:
            w.close()
    return {
        "streams": streams,
        "streams_open_at_workers": opened,
        "rss_rest_mb": round(rest / 2**20, 1),
        "rss_open_mb": round(held / 2**20, 1),
        "kib_per_open_stream": round((held - rest) / 1024 / max(opened, 1), 1),
    }


@contextlib.contextmanager
def fleet(
    pipeline: str,
    n: int,
    replicas: int,
    token_rate: float,
    logs: Path,
    poll_interval_s: float | None = None,
) -> Iterator[tuple[Stubs, list[tuple[str, subprocess.Popen]]]]:
    """Stubs, a Redis where there are several replicas, the routers; stopped after."""
    procs: list[subprocess.Popen] = []
    routers: list[tuple[str, subprocess.Popen]] = []
    try:
        stubs = start_stubs(pipeline, n, token_rate, logs)
        procs += stubs.procs
        redis_url = None
        if replicas > 1:
            redis, redis_url = start_redis(logs)
            procs.append(redis)
        routers = start_routers(stubs, pipeline, replicas, redis_url, logs, poll_interval_s)
        yield stubs, routers
    finally:
        stop([p for _, p in routers])  # first: they poll the stubs
        stop(procs)


@dataclass
class BenchArgs:
    stub_workers: int
    pipeline: str = "P-MD"
    replicas: list[int] = field(default_factory=lambda: [1])
    rates: list[float] = field(default_factory=lambda: [100, 200, 400, 800, 1600])
    duration_s: float = 5.0
    max_tokens: int = 16
    long_tokens: int = 256
    token_phase_rps: float = 20.0
    token_rate: float = 1000.0
    ttft_requests: int = 200
    open_streams: int = 256
    max_inflight: int = 512
    conversations: int = 64
    idle_s: float = 5.0
    #: The routers' ``--poll-interval-s``; None: their default.
    poll_interval_s: float | None = None


def run(args: BenchArgs) -> dict:
    logs = Path(tempfile.mkdtemp(prefix="pdd-bench-router-stubs-"))
    print(f"logs: {logs}", flush=True)
    result: dict = {"config": vars(args) | {"logs": str(logs)}, "replicas": {}}
    for replicas in args.replicas:
        print(
            f"{replicas} router replica(s), {args.stub_workers} stub workers ({args.pipeline})",
            flush=True,
        )
        group = fleet(
            args.pipeline, args.stub_workers, replicas, args.token_rate, logs, args.poll_interval_s
        )
        with group as (stubs, routers):
            result["replicas"][str(replicas)] = asyncio.run(
                measure(args, stubs, routers, full=replicas == args.replicas[0])
            )
    first = result["replicas"][str(args.replicas[0])]
    result |= {
        k: first[k]
        for k in ("routed_requests_per_core_s", "cpu_us_per_request", "cpu_us_per_streamed_token")
        if k in first
    }
    return result


async def measure(
    args: BenchArgs, stubs: Stubs, routers: list[tuple[str, subprocess.Popen]], full: bool
) -> dict:
    """Every figure for one fleet; ``full``: also streams, TTFT and memory (the first
    replica count only; the others measure the plain ramp and decision quality)."""
    procs = [psutil.Process(p.pid) for _, p in routers]
    cpu = lambda: cpu_seconds(procs)  # noqa: E731
    load = Load([u for u, _ in routers], Conversations(count=args.conversations), args.max_inflight)
    decode_role = "mono" if args.pipeline == "mono" else "main"
    await open_loop(load, args.rates[0], 2.0, False, args.max_tokens, cpu)  # warm-up
    idle = await idle_cores(cpu, args.idle_s)
    before, counted_from = stubs.stats(), len(load.sent_prompts)
    plain = await ramp(load, args.rates, args.duration_s, False, args.max_tokens, cpu, idle)
    quality = decision_quality(before, stubs.stats(), stubs.roles)
    best = busiest(plain)
    out: dict = {
        "router_processes": len(routers),
        "plain_steps": [s.summary() for s in plain],
        "routed_requests_s": round(best.achieved_rps, 1),
        "routed_requests_per_core_s": round(per_core_rate(best.ok, best.request_cpu_s), 1),
        "cpu_us_per_request": round(cpu_us_per(best.request_cpu_s, best.ok), 1),
        "cpu_us_per_request_with_polls": round(cpu_us_per(best.router_cpu_s, best.ok), 1),
        "router_cores_busy_at_best": round(best.router_cpu_s / best.wall_s, 3),
        "poll_cores_at_rest": round(idle, 4),
        "failed": sum(s.failed for s in plain),
        "decision_quality": quality,
        "ideal_prefix_hit_rate": round(ideal_hit_rate(load.sent_prompts, 16, counted_from), 4),
    }
    if not full:
        return out
    streamed = await ramp(load, args.rates, args.duration_s, True, args.max_tokens, cpu, idle)
    sbest = busiest(streamed)
    rps, seconds = args.token_phase_rps, args.duration_s
    short = await open_loop(load, rps, seconds, True, args.max_tokens, cpu, idle)
    long = await open_loop(load, rps, seconds, True, args.long_tokens, cpu, idle)
    out |= {
        "stream_steps": [s.summary() for s in streamed],
        "streamed_requests_s": round(sbest.achieved_rps, 1),
        "streamed_requests_per_core_s": round(per_core_rate(sbest.ok, sbest.request_cpu_s), 1),
        "cpu_us_per_streamed_request": round(cpu_us_per(sbest.request_cpu_s, sbest.ok), 1),
        "token_cost_steps": {
            "short": short.summary() | {"tokens": short.tokens},
            "long": long.summary() | {"tokens": long.tokens},
        },
        "cpu_us_per_streamed_token": round(streamed_token_cost(short, long), 2),
        "ttft": await ttft(load, stubs, args.pipeline, args.ttft_requests, args.max_tokens),
        "memory": await stream_memory(load, stubs, decode_role, procs[0], args.open_streams),
        "failed": out["failed"] + sum(s.failed for s in (*streamed, short, long)),
    }
    return out


def table(result: dict) -> str:
    """The replicas side by side: aggregate throughput, cost, decision quality."""
    runs = result["replicas"]
    cols = list(runs)
    decode = "mono" if result["config"]["pipeline"] == "mono" else "main"

    def row(name: str, value: Callable[[dict], object]) -> str:
        return f"{name:<34}" + "".join(f"{value(runs[c])!s:>12}" for c in cols)

    lines = [
        row("router replicas", lambda r: r["router_processes"]),
        row("routed req/s (plain, aggregate)", lambda r: r["routed_requests_s"]),
        row("routed req/s per router core", lambda r: r["routed_requests_per_core_s"]),
        row("router CPU us / request", lambda r: r["cpu_us_per_request"]),
        row("router cores busy at best step", lambda r: r["router_cores_busy_at_best"]),
        row(
            f"prefix-hit rate ({decode})",
            lambda r: r["decision_quality"][decode]["prefix_hit_rate"],
        ),
    ]
    if decode == "main":
        lines.append(
            row(
                "prefix-hit rate (prefill)",
                lambda r: r["decision_quality"]["prefill"]["prefix_hit_rate"],
            )
        )
    lines += [
        row("ideal prefix-hit rate", lambda r: r["ideal_prefix_hit_rate"]),
        row(
            f"load spread max/mean ({decode})",
            lambda r: r["decision_quality"][decode]["load_spread"]["max_over_mean"],
        ),
        row("failed requests", lambda r: r["failed"]),
    ]
    first = runs[cols[0]]
    if "cpu_us_per_streamed_token" in first:
        lines += [
            "",
            f"streaming (1 router): {first['streamed_requests_s']} req/s, "
            f"{first['streamed_requests_per_core_s']} per core, "
            f"{first['cpu_us_per_streamed_request']} us/request, "
            f"{first['cpu_us_per_streamed_token']} us/streamed token",
            f"TTFT added by the router: p50 {first['ttft']['p50']['added_ms']} ms, "
            f"p99 {first['ttft']['p99']['added_ms']} ms "
            f"(router {first['ttft']['p50']['router_ms']}/{first['ttft']['p99']['router_ms']}, "
            f"direct {first['ttft']['p50']['direct_ms']}/{first['ttft']['p99']['direct_ms']})",
            f"memory: {first['memory']['kib_per_open_stream']} KiB per open stream "
            f"({first['memory']['streams_open_at_workers']} streams)",
        ]
    return "\n".join(lines)
