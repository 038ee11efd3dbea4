"""Pipelines side by side: mono, naive cross-datacenter PD, and PDD on the same requests.

    python bench/pipeline.py [--conversations 16] [--link-gbps 0.05] [--link-rtt-ms 30]
        [--link-jitter-ms 5] [--max-tokens 48] [--json OUT]

Starts real worker processes (P, RLD, MD, mono) and a WAN link emulator in
front of each WAN-facing worker, then replays the same two-turn conversations
(turn 2 = turn 1 + its answer + a new message, the traffic that makes the
decode-side radix cache pay) through each system:

* ``mono``: one colocated instance (no WAN at all: the lower bound);
* ``naive``: P then MD across the WAN, shipping the full KV, no DRC;
* ``pdd``: P-RLD-MD: dual-path KV, eager tokens from RLD, only MD's miss on the WAN.

Reported per system: TTFT p50/p90/p99, the largest inter-token stall seen by
any client, and the KV bytes that crossed the WAN. Systems run one after the
other, pdd before naive (so pdd's MD starts cold; naive empties MD's cache anyway).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pdd.common.wan_line import add_line_flags, parsed_line
from pdd.common.wire import PipelinePlan, SamplingSpec
from pdd.local.cluster import LinkSpec, LocalCluster, WorkerSpec
from pdd.local.topology import DEFAULT_LINK
from pdd.router.stream_relay import relay_tokens
from pdd.router.worker_client import WorkerClient
from pdd.simulator.stats import percentile

SPECS = [
    WorkerSpec("p", "prefill"),
    WorkerSpec("rld", "relay", wan_facing=True),
    WorkerSpec("md", "main", wan_facing=True),
    WorkerSpec("mono", "mono"),
]
SYSTEMS = {"mono": "mono", "pdd": "P-RLD-MD", "naive": "naive"}


def conversation_parser(
    description: str, *, conversations: int, max_tokens: int, jitter_ms: float
) -> argparse.ArgumentParser:
    """The options of a two-turn conversation replay over the emulated WAN link (this
    bench's and bench/pmd_latency.py's), with each bench's own defaults."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--conversations", type=int, default=conversations)
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--turn2-tokens", type=int, default=40, help="new tokens in turn 2")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    # The line's flags (``WanLine``), defaulting to pdd up's line with this bench's jitter.
    line = DEFAULT_LINK.model_copy(update={"jitter_ms": jitter_ms})
    add_line_flags(p, line, only={"gbps", "rtt_ms", "jitter_ms"})
    p.add_argument("--model", default="tiny")
    p.add_argument("--json", help="write the results here as JSON")
    return p


def start_cluster(
    specs: list[WorkerSpec], logs: Path, args: argparse.Namespace, *extra: str
) -> tuple[LocalCluster, LinkSpec]:
    """The replay's workers (one torch thread each) on the emulated link the options set."""
    link = parsed_line(args, LinkSpec)
    common = ["--model", args.model, "--torch-threads", "1", "--num-blocks", "2048", *extra]
    return LocalCluster.start(specs, logs, link, common_args=common), link


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    description = __doc__.splitlines()[0]
    p = conversation_parser(description, conversations=16, max_tokens=48, jitter_ms=5.0)
    return p.parse_args(argv)


def wan_bytes(cluster: LocalCluster) -> float:
    return cluster["p"].metrics().get("pdd_worker_wan_kv_bytes_total", 0.0)


@dataclass(frozen=True)
class Timed:
    """One request as its client saw it: the tokens, when the first came, the longest stall."""

    token_ids: list[int]
    first_token_s: float
    max_gap_s: float


async def timed(plan: PipelinePlan, client: WorkerClient) -> Timed:
    """Run ``plan`` through the router's stream relay, timing what the client receives."""
    start = last = time.monotonic()
    first, gap, ids = 0.0, 0.0, []
    async for event in relay_tokens(plan, client, 600.0):
        if not event.is_token:  # the finish event that may follow the last token
            continue
        now = time.monotonic()
        first = first or now - start
        gap, last = max(gap, now - last), now
        ids.append(event.token_id)
    return Timed(ids, first, gap)


async def run_turn(
    cluster: LocalCluster, system: str, prompts: list[list[int]], tag: str, max_tokens: int
) -> list[Timed]:
    def plan(i: int, prompt: list[int]) -> PipelinePlan:
        return cluster.plan(
            f"{system}-{tag}-{i}", prompt, SYSTEMS[system],
            SamplingSpec(max_tokens=max_tokens, ignore_eos=True),
            main="mono" if system == "mono" else "md",
        )  # fmt: skip

    client = WorkerClient(cluster.secret, timeout_s=60.0)
    try:
        return list(
            await asyncio.gather(*(timed(plan(i, p), client) for i, p in enumerate(prompts)))
        )
    finally:
        await client.aclose()


async def run_system(cluster: LocalCluster, system: str, args: argparse.Namespace) -> dict:
    rng = random.Random(7)
    turn1 = [
        [rng.randrange(256) for _ in range(args.prompt_tokens)] for _ in range(args.conversations)
    ]
    before = wan_bytes(cluster)
    first = await run_turn(cluster, system, turn1, "t1", args.max_tokens)
    turn2 = [
        p + r.token_ids + [rng.randrange(256) for _ in range(args.turn2_tokens)]
        for p, r in zip(turn1, first, strict=True)
    ]
    second = await run_turn(cluster, system, turn2, "t2", args.max_tokens)
    results = first + second
    # A request can finish on the relay while its KV is still crossing the WAN to MD: wait
    # until every worker is idle so this system's bytes are not counted in the next one's.
    await asyncio.to_thread(cluster.wait_quiescent, 120.0)
    ttft = [r.first_token_s * 1000 for r in results]
    return {
        "system": system,
        "requests": len(results),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_mean_ms": statistics.fmean(ttft),
        "max_stall_ms": max(r.max_gap_s for r in results) * 1000,
        "wan_kv_bytes": wan_bytes(cluster) - before,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdd-bench-") as logs:
        cluster, _ = start_cluster(SPECS, Path(logs), args)
        try:
            results = [asyncio.run(run_system(cluster, s, args)) for s in SYSTEMS]
        finally:
            cluster.stop()
    print(
        f"{args.conversations} two-turn conversations, {args.prompt_tokens}-token prompts, "
        f"WAN {args.link_gbps} Gbit/s RTT {args.link_rtt_ms} ms jitter {args.link_jitter_ms} ms"
    )
    head = f"{'system':<8}{'TTFT p50':>10}{'p90':>10}{'p99':>10}{'max stall':>11}{'WAN KV MB':>11}"
    print(head + "   (ms)")
    for r in results:
        print(
            f"{r['system']:<8}{r['ttft_p50_ms']:>10.1f}{r['ttft_p90_ms']:>10.1f}"
            f"{r['ttft_p99_ms']:>10.1f}{r['max_stall_ms']:>11.1f}{r['wan_kv_bytes'] / 1e6:>11.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
