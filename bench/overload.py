"""Overload: the stack's capacity found by a ramp, then 2x and 4x of it, with two API keys.

    python bench/overload.py [--step-s 10] [--phase-s 20] [--max-tokens 16]
                             [--ttft-budget-s 2.0] [--port 8151] [--json OUT]

Starts real ``pdd worker`` processes (P, RLD, MD; the tiny model) and ``pdd router`` on
loopback, and drives ``/v1/completions`` (streaming) with open-loop Poisson arrivals.

1. **Ramp** (router without a capacity): the arrival rate grows step by step; the
   capacity is the highest rate whose TTFT p99 stays within the budget with every
   request served. The mean time a request is in flight at that rate times the rate
   (Little's law) gives the router's ``--max-inflight-requests`` for the rest.
2. **Overload**: a router with that capacity (and ``--admission-wait-s``, a quarter of
   the budget) takes 1x, 2x and 4x the capacity, 80% of it from a noisy key and 20%
   from a quiet one; reported per phase and key: the share admitted, the admitted
   requests' TTFT p99, the share answered 429 (each with ``Retry-After``).
3. **Recovery**: after the 4x phase, probes at a low rate until their TTFT is back
   within 1.5x of the unloaded one: the seconds that took.

Figures on a shared 2-core machine are noisy: read them as ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdd.local.cluster import LinkSpec, LocalCluster, WorkerSpec
from pdd.simulator.stats import percentile

KEYS = {"noisy": "sk-noisy", "quiet": "sk-quiet"}
NOISY_SHARE = 0.8


@dataclass
class Outcome:
    key: str
    status: int
    ttft_s: float | None = None
    latency_s: float | None = None
    retry_after: str | None = None


@dataclass
class Phase:
    name: str
    rate: float
    outcomes: list[Outcome] = field(default_factory=list)

    def report(self, key: str | None = None) -> dict:
        rows = [o for o in self.outcomes if key is None or o.key == key]
        ok = [o for o in rows if o.status == 200 and o.ttft_s is not None]
        shed = [o for o in rows if o.status == 429]
        ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
        return {
            "offered": len(rows),
            "admitted_share": len(ok) / len(rows) if rows else 0.0,
            "shed_429_share": len(shed) / len(rows) if rows else 0.0,
            "shed_with_retry_after": all(o.retry_after for o in shed),
            "other_errors": len(rows) - len(ok) - len(shed),
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
            "latency_mean_s": (
                sum(o.latency_s for o in ok if o.latency_s) / len(ok) if ok else None
            ),
        }


async def one_request(http: httpx.AsyncClient, url: str, key: str, max_tokens: int) -> Outcome:
    body = {
        "model": "tiny",
        "prompt": f"overload probe {random.random():.6f}: the quick brown fox",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEYS[key]}"}
    started = time.monotonic()
    ttft = None
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return Outcome(key, r.status_code, retry_after=r.headers.get("retry-after"))
            async for line in r.aiter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = time.monotonic() - started
        return Outcome(key, 200, ttft, time.monotonic() - started)
    except httpx.HTTPError:
        return Outcome(key, 0)


async def run_phase(url: str, phase: Phase, duration_s: float, max_tokens: int) -> Phase:
    """Poisson arrivals at ``phase.rate`` for ``duration_s``; waits for every request."""
    rng = random.Random(hash(phase.name) & 0xFFFF)
    tasks = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            key = "noisy" if rng.random() < NOISY_SHARE else "quiet"
            tasks.append(asyncio.create_task(one_request(http, url, key, max_tokens)))
            await asyncio.sleep(rng.expovariate(phase.rate))
        phase.outcomes = list(await asyncio.gather(*tasks))
    return phase


async def recovery(url: str, baseline_s: float, max_tokens: int, limit_s: float = 120.0) -> float:
    """Seconds after the overload until a probe's TTFT is within 1.5x the unloaded one
    (three probes in a row)."""
    started, good = time.monotonic(), 0
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() - started < limit_s:
            o = await one_request(http, url, "quiet", max_tokens)
            good = good + 1 if o.status == 200 and o.ttft_s and o.ttft_s <= 1.5 * baseline_s else 0
            if good == 3:
                return time.monotonic() - started
            await asyncio.sleep(0.2)
    return float("inf")


def start_router(cluster: LocalCluster, port: int, log: Path, *extra: str) -> subprocess.Popen:
    keys = [a for k in KEYS.values() for a in ("--api-key", k)]
    return run_router(cluster, port, log, "--relay", f"rld={cluster['rld'].url}", *keys, *extra)


def run_router(cluster: LocalCluster, port: int, log: Path, *flags: str) -> subprocess.Popen:
    """A tiny-model router in front of the cluster's P and MD (plus ``flags``), once it
    answers /ready (the other benchmarks in this folder start theirs through it)."""
    argv = [
        sys.executable, "-m", "pdd.cli", "router", "--model", "tiny", "--host", "127.0.0.1",
        "--port", str(port), "--poll-interval-s", "0.2",
        "--prefill", f"p={cluster['p'].url}", "--main", f"md={cluster['md'].url}", *flags,
    ]  # fmt: skip
    env = {**os.environ, "PDD_SHARED_SECRET": cluster.secret}
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"router did not start: {log.read_text()[-2000:]}")


async def bench(args: argparse.Namespace, cluster: LocalCluster, tmp: Path) -> dict:
    budget = args.ttft_budget_s
    url = f"http://127.0.0.1:{args.port}"
    router = start_router(cluster, args.port, tmp / "ramp-router.log")
    try:
        idle = await run_phase(url, Phase("idle", 1.0), args.step_s, args.max_tokens)
        baseline = idle.report()["ttft_p50_s"]
        ramp, capacity, in_flight = [], None, None
        rate = args.start_rate
        while rate <= args.max_rate:
            step = await run_phase(url, Phase(f"ramp-{rate:g}", rate), args.step_s, args.max_tokens)
            r = step.report()
            ramp.append({"rate": rate, **r})
            print(f"ramp {rate:g}/s: {r}", flush=True)
            if r["admitted_share"] < 1.0 or (r["ttft_p99_s"] or 1e9) > budget:
                break
            capacity, in_flight = rate, rate * r["latency_mean_s"]
            rate *= 1.5
    finally:
        router.terminate()
        router.wait(10)
    if capacity is None:
        raise RuntimeError(f"even {args.start_rate}/s missed the budget: {ramp}")
    slots = max(1, round(in_flight or 1))
    wait_s = budget / 4
    router = start_router(
        cluster, args.port + 1, tmp / "overload-router.log",
        "--max-inflight-requests", str(slots), "--admission-wait-s", str(wait_s),
    )  # fmt: skip
    url = f"http://127.0.0.1:{args.port + 1}"
    phases = {}
    try:
        for mult in (1, 2, 4):
            phase = await run_phase(
                url, Phase(f"{mult}x", capacity * mult), args.phase_s, args.max_tokens
            )
            phases[f"{mult}x"] = {
                "rate": capacity * mult,
                "all": phase.report(),
                "noisy": phase.report("noisy"),
                "quiet": phase.report("quiet"),
            }
            print(f"{mult}x: {phases[f'{mult}x']['all']}", flush=True)
        recovered_s = await recovery(url, baseline, args.max_tokens)
    finally:
        router.terminate()
        router.wait(10)
    return {
        "cpu_flags_avx512": "avx512f" in Path("/proc/cpuinfo").read_text(),
        "ttft_budget_s": budget,
        "unloaded_ttft_p50_s": baseline,
        "ramp": ramp,
        "capacity_rps": capacity,
        "max_inflight_requests": slots,
        "admission_wait_s": wait_s,
        "phases": phases,
        "recovery_s": recovered_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-s", type=float, default=10.0, help="seconds per ramp step")
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds per overload phase")
    parser.add_argument("--start-rate", type=float, default=2.0, help="first ramp rate (req/s)")
    parser.add_argument("--max-rate", type=float, default=200.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ttft-budget-s", type=float, default=2.0)
    parser.add_argument("--port", type=int, default=8151, help="router ports: PORT, PORT+1")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pdd-overload-"))
    specs = [
        WorkerSpec("p", "prefill"),
        WorkerSpec("rld", "relay", wan_facing=True),
        WorkerSpec("md", "main", wan_facing=True),
    ]
    common = ["--model", "tiny", "--num-blocks", "1024", "--torch-threads", "1"]
    cluster = LocalCluster.start(specs, tmp, LinkSpec(gbps=10.0), common_args=common)
    try:
        result = asyncio.run(bench(args, cluster, tmp))
    finally:
        cluster.stop()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
