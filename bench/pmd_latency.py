"""P-MD's fixed cost at low load: its TTFT against same-datacenter PD's, next to the floor.

    python bench/pmd_latency.py [--conversations 20] [--prompt-tokens 400]
        [--turn2-tokens 40] [--max-tokens 16] [--link-gbps 0.05] [--link-rtt-ms 30]
        [--link-jitter-ms 0] [--json OUT]

Starts real worker processes: P; ``md``, a main decode across an emulated WAN line
(``pdd wan-link``: its data port and its control API both behind the line, as the
router reaches MD's HTTP across the WAN, so its tokens pay the line's one-way delay);
and ``md_local``, a main decode in P's datacenter (no line): same-DC PD. Requests run
one at a time (low load: no queueing anywhere), each P-MD, as two-turn conversations
so both request classes show up:

* ``new``: a conversation's first turn: MD holds nothing of it, the whole prompt's
  KV crosses;
* ``next turn``: turn 1 + its answer + ``--turn2-tokens`` new tokens: MD holds
  turn 1 (its radix cache), only the new part's KV crosses.

Each system gets its own conversations (same lengths), so P's prefix cache favours
neither. Plans carry the router's predicted MD hit (``main_hit_tokens``: what MD's
cache events tell the router's prefix index, the full blocks of turn 1's prompt and
answer MD computed) where this build's ``PipelinePlan`` has that field; on a build
without it the same script measures the old protocol.

Reported per class: P-MD TTFT p50, same-DC TTFT p50, their difference, the prefill
(P's own timing of each prompt it computed, ``pdd_worker_request_prefill_time_seconds``,
read between requests: its p50 over the P-MD half, the one that streams; the same-DC
half's beside it), the transfer (the miss's KV wire bytes / line rate), the floor (1 RTT +
the longer of prefill and transfer: P streams the KV while it prefills, the KV one way
and the first token back) and the target for the difference (1 RTT + max(0, transfer -
prefill) + 10 ms); plus the p50 gap before the second token and the median KV wire
bytes that crossed per request. ``--max-num-batched-tokens`` sets the workers' step
budget (``--max-num-batched-tokens``): a prompt longer than it prefills in chunks,
each one's KV on the line as its step ends. The machine's load average
(``/proc/loadavg``) is printed beside the figures: the processes share its cores.
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

from pipeline import conversation_parser, start_cluster  # bench/pipeline.py, beside this script

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE
from pdd.common.wire import Endpoint, PipelinePlan, SamplingSpec
from pdd.local.cluster import (
    HOST,
    LinkSpec,
    LocalCluster,
    WanLinkProc,
    WorkerSpec,
    free_port,
    wait_http_ok,
    wan_link_argv,
)
from pdd.local.supervisor import spawn_pdd
from pdd.router.stream_relay import relay_tokens
from pdd.router.worker_client import WorkerClient
from pdd.simulator.stats import percentile

SPECS = [
    WorkerSpec("p", "prefill"),
    WorkerSpec("md", "main", wan_facing=True),
    WorkerSpec("md_local", "main"),
]
SYSTEMS = {"P-MD (WAN)": "md", "same-DC": "md_local"}
CLASSES = ("new", "next turn")
PREDICTS = "main_hit_tokens" in PipelinePlan.model_fields
PREFILL_SUM = 'pdd_worker_request_prefill_time_seconds_sum{role="prefill"}'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    description = __doc__.splitlines()[0]
    p = conversation_parser(description, conversations=20, max_tokens=16, jitter_ms=0.0)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=512,
        help="the workers' --max-num-batched-tokens (default 512, the worker's own)",
    )  # fmt: skip
    return p.parse_args(argv)


@dataclass(frozen=True)
class Timed:
    """One request as its client saw it."""

    token_ids: list[int]
    first_token_s: float
    second_gap_s: float  # between the first and the second token
    kv_wire_bytes: float  # P's WAN KV chunks as sent, for this request
    prefill_s: float  # P's prefill of this request, as P timed it


async def timed(plan: PipelinePlan, client: WorkerClient, cluster: LocalCluster) -> Timed:
    """Run ``plan`` through the router's stream relay, timing what the client receives."""
    before = p_totals(cluster)
    start = time.monotonic()
    stamps, ids = [], []
    async for event in relay_tokens(plan, client, 120.0):
        if event.is_token:  # not the finish event that may follow the last token
            stamps.append(time.monotonic() - start)
            ids.append(event.token_id)
    await asyncio.to_thread(cluster.wait_quiescent, 60.0)  # low load: one at a time
    gap = stamps[1] - stamps[0] if len(stamps) > 1 else 0.0
    after = p_totals(cluster)  # one request at a time: the deltas are this one's
    return Timed(ids, stamps[0], gap, after[0] - before[0], after[1] - before[1])


def p_totals(cluster: LocalCluster) -> tuple[float, float]:
    """P's running totals, from one scrape: WAN KV bytes as coded, and prefill seconds
    (its histogram's sum)."""
    metrics = cluster["p"].metrics()
    return metrics.get("pdd_worker_wan_kv_coded_bytes_total", 0.0), metrics.get(PREFILL_SUM, 0.0)


def md_holds(turn1: list[int], answer: list[int]) -> int:
    """The router's prediction after turn 1: MD cached the full blocks of what it
    computed (the prompt and every answer token but the last, which is never fed)."""
    computed = len(turn1) + len(answer) - 1
    return computed // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE


class Bench:
    def __init__(self, cluster: LocalCluster, md_http: str, args: argparse.Namespace) -> None:
        self.cluster = cluster
        self.md_http = md_http  # MD's control API as the router reaches it: across the line
        self.args = args

    def plan(self, rid: str, prompt: list[int], main: str, predicted: int) -> PipelinePlan:
        sampling = SamplingSpec(max_tokens=self.args.max_tokens, ignore_eos=True)
        extra = {"main_hit_tokens": predicted} if PREDICTS else {}
        plan = self.cluster.plan(rid, prompt, "P-MD", sampling, main=main, **extra)
        if main == "md":
            endpoint = Endpoint(**{**plan.main.model_dump(), "http_url": self.md_http})  # type: ignore[union-attr]
            plan = plan.model_copy(update={"main": endpoint})
        return plan

    async def run_system(self, system: str, main: str, seed: int) -> dict[str, list[Timed]]:
        rng = random.Random(seed)
        a = self.args
        client = WorkerClient(self.cluster.secret, timeout_s=60.0)
        out: dict[str, list[Timed]] = {c: [] for c in CLASSES}
        try:
            for i in range(a.conversations):
                turn1 = [rng.randrange(256) for _ in range(a.prompt_tokens)]
                first = await timed(
                    self.plan(f"{main}-{i}-t1", turn1, main, 0), client, self.cluster
                )
                turn2 = (
                    turn1 + first.token_ids + [rng.randrange(256) for _ in range(a.turn2_tokens)]
                )
                held = md_holds(turn1, first.token_ids)
                second = await timed(
                    self.plan(f"{main}-{i}-t2", turn2, main, held), client, self.cluster
                )
                out["new"].append(first)
                out["next turn"].append(second)
        finally:
            await client.aclose()
        return out


def start_md_http_line(
    cluster: LocalCluster, link: LinkSpec, logs: Path
) -> tuple[WanLinkProc, str]:
    """A second emulated line, same rate and delay, in front of MD's control API."""
    listen, admin = free_port(), free_port()
    md_http = cluster["md"].url.removeprefix("http://")
    argv = wan_link_argv(link, [(f"{HOST}:{listen}", md_http)], f"{HOST}:{admin}")
    env = {"PDD_SHARED_SECRET": cluster.secret}
    proc = WanLinkProc(
        spawn_pdd(argv, logs / "md-http-line.log", env),
        f"http://{HOST}:{admin}",
        logs / "md-http-line.log",
    )
    if not wait_http_ok(f"{proc.admin_url}/stats", time.monotonic() + 60, lambda: None):
        raise RuntimeError("the line in front of MD's control API did not come up")
    return proc, f"http://{HOST}:{listen}"


def summarize(results: dict[str, dict[str, list[Timed]]], args: argparse.Namespace) -> list[dict]:
    rate = args.link_gbps * 1e9 / 8
    rows = []
    for cls in CLASSES:
        wan, local = results["P-MD (WAN)"][cls], results["same-DC"][cls]
        wan_p50 = percentile([r.first_token_s for r in wan], 50) or 0.0
        local_p50 = percentile([r.first_token_s for r in local], 50) or 0.0
        miss = statistics.median(r.kv_wire_bytes for r in wan)
        prefill = statistics.median(r.prefill_s for r in wan)
        rtt, transfer = args.link_rtt_ms / 1000, miss / rate
        floor = rtt + max(prefill, transfer)
        target = rtt + max(0.0, transfer - prefill) + 0.010
        gap = {name: percentile([r.second_gap_s for r in runs], 50) or 0.0
               for name, runs in (("wan", wan), ("local", local))}  # fmt: skip
        rows.append({
            "class": cls,
            "requests": len(wan),
            "pmd_ttft_p50_ms": wan_p50 * 1000,
            "same_dc_ttft_p50_ms": local_p50 * 1000,
            "difference_ms": (wan_p50 - local_p50) * 1000,
            "prefill_ms": prefill * 1000,
            "same_dc_prefill_ms": statistics.median(r.prefill_s for r in local) * 1000,
            "over_target_ms": (wan_p50 - local_p50 - target) * 1000,
            "transfer_ms": transfer * 1000,
            "floor_ms": floor * 1000,
            "target_difference_ms": target * 1000,
            "pmd_token2_gap_p50_ms": gap["wan"] * 1000,
            "same_dc_token2_gap_p50_ms": gap["local"] * 1000,
            "miss_kv_wire_bytes_p50": miss,
        })  # fmt: skip
    return rows


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdd-bench-") as logs:
        cluster, link = start_cluster(
            SPECS, Path(logs), args, "--block-size", str(DEFAULT_BLOCK_SIZE),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        )  # fmt: skip
        line = None
        try:
            line, md_http = start_md_http_line(cluster, link, Path(logs))
            bench = Bench(cluster, md_http, args)
            load_before = loadavg()
            results = {
                system: asyncio.run(bench.run_system(system, main, seed))
                for seed, (system, main) in enumerate(SYSTEMS.items())
            }
            load_after = loadavg()
        finally:
            cluster.stop()
            if line is not None:
                line.proc.terminate()
                line.proc.wait(10)
    rows = summarize(results, args)
    print(
        f"P-MD vs same-DC PD, {args.conversations} two-turn conversations one at a time, "
        f"{args.prompt_tokens}-token prompts (+{args.turn2_tokens} in turn 2), WAN "
        f"{args.link_gbps} Gbit/s RTT {args.link_rtt_ms} ms jitter {args.link_jitter_ms} ms; "
        f"prefill chunks {args.max_num_batched_tokens} tokens; predicted MD hit "
        f"{'on' if PREDICTS else 'off (this build has none)'}; "
        f"load avg {load_before} -> {load_after}"
    )
    head = (
        f"{'class':<10}{'P-MD p50':>10}{'same-DC':>10}{'diff':>8}{'prefill':>9}{'transfer':>9}"
        f"{'floor':>8}{'target diff':>12}{'over':>7}{'tok2 gap':>10}{'same-DC':>9}"
        f"{'miss KB':>9}{'same-DC prefill':>16}"
    )
    print(head + "   (ms)")
    for r in rows:
        print(
            f"{r['class']:<10}{r['pmd_ttft_p50_ms']:>10.1f}{r['same_dc_ttft_p50_ms']:>10.1f}"
            f"{r['difference_ms']:>8.1f}{r['prefill_ms']:>9.1f}{r['transfer_ms']:>9.1f}"
            f"{r['floor_ms']:>8.1f}{r['target_difference_ms']:>12.1f}{r['over_target_ms']:>7.1f}"
            f"{r['pmd_token2_gap_p50_ms']:>10.1f}{r['same_dc_token2_gap_p50_ms']:>9.1f}"
            f"{r['miss_kv_wire_bytes_p50'] / 1e3:>9.1f}{r['same_dc_prefill_ms']:>16.1f}"
        )
    if args.json:
        out = {"config": vars(args), "predicts": PREDICTS, "load": [load_before, load_after]}
        Path(args.json).write_text(json.dumps({**out, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
