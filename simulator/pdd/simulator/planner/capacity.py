"""The fast half of the planner: replicas per pool from the simulator's step-time model
(:class:`pdd.simulator.hardware.InstanceShape`, the calibrated formula every simulated
engine step uses) and textbook queueing, in microseconds, so it can run every interval.

* **P** is an M/G/c queue: a request's service is the chunked prefill of its miss
  (``prefill_seconds`` per chunk). TTFT P90 = the Erlang-C waiting time's P90, scaled by
  the Allen-Cunneen factor (1 + SCV) / 2 for the misses' spread (agentic turns are
  bimodal: warm turns miss a few blocks, first turns miss everything), plus the
  service's, plus the first token's trip (the line, at most the router's budget).
* **MD** (and same-datacenter D) decode at the largest batch whose step time meets the
  ITL target and whose KV fits; by Little's law a replica then carries ``batch / step``
  tokens per second.
* **RLD** holds a relayed request while MD's KV crosses: its concurrency is the relayed
  rate times the crossing (at least the router's TTFT budget, which is why it relayed).

It is a first guess, not the verdict: ``pdd plan`` checks and corrects it with the
discrete-event simulation (:mod:`pdd.simulator.planner.search`), and the planner loop
corrects it with the latency it measures (:mod:`pdd.simulator.planner.planner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdd.simulator.hardware import InstanceShape
from pdd.simulator.planner.load import ObservedLoad, Slo

#: Highest utilization sized for: queues explode as it nears 1, and the step model has
#: no per-sequence or extend cost beyond the formula.
TARGET_UTILIZATION = 0.85
#: The share of the ITL target a decode step may take (extends and admissions add pauses).
ITL_STEP_SHARE = 0.9
#: Highest share of the line sized for: past it, transfers queue behind each other.
LINE_UTILIZATION = 0.7
_LN10 = math.log(10.0)


@dataclass(frozen=True)
class PoolModel:
    """One pool as the step model sees it."""

    shape: InstanceShape
    max_batch: int = 64  # decode pools
    chunk_tokens: int = 8192  # prefill pools


@dataclass(frozen=True)
class DeploymentModel:
    """The pools and the line the planner sizes (from a scenario: ``from_scenario``)."""

    pools: dict[str, PoolModel]
    kv_bytes_per_token: float  # on the line (PDD) or the RDMA path (same-DC)
    line_gbps: float  # the line (or the in-datacenter NIC for same-DC)
    rtt_s: float
    ttft_budget_s: float  # the router's: a slower first token from MD is relayed

    def line_seconds(self, tokens: float) -> float:
        """One transfer of ``tokens`` of KV on an idle line."""
        return self.rtt_s + tokens * self.kv_bytes_per_token * 8 / (self.line_gbps * 1e9)


def prefill_service_s(pool: PoolModel, miss: float, cached: float) -> float:
    """Seconds P spends on one request: its miss in full chunks after ``cached`` tokens."""
    seconds, done = 0.0, 0.0
    while done < miss:
        step = min(pool.chunk_tokens, miss - done)
        seconds += pool.shape.prefill_seconds(step, cached + done)
        done += step
    return seconds


def erlang_c(servers: int, offered: float) -> float:
    """Probability an arrival waits in M/M/c (``offered`` = arrival rate x service time)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocking = 1.0
    for k in range(1, servers + 1):  # Erlang B by recursion: no factorials
        blocking = offered * blocking / (k + offered * blocking)
    return servers * blocking / (servers - offered * (1 - blocking))


def ttft_p90_estimate(
    servers: int, rate: float, service_s: float, trip_s: float, scv: float = 1.0
) -> float:
    """M/M/c: P(wait > t) = C e^{-(c - a) t / s}, times (1 + scv) / 2 for M/G/c; plus the
    service's P90 and the trip."""
    offered = rate * service_s
    if offered >= servers:
        return math.inf
    waits = erlang_c(servers, offered)
    wait_p90 = service_s / (servers - offered) * math.log(waits / 0.1) if waits > 0.1 else 0.0
    wait_p90 *= (1 + scv) / 2
    return wait_p90 + service_s * _LN10 + trip_s


def first_token_trip_s(model: DeploymentModel, load: ObservedLoad) -> float:
    """After the prefill: the mean miss's crossing, but never past the router's budget
    (a slower one is relayed and the relay answers at once)."""
    return min(model.line_seconds(load.md_miss_tokens), model.ttft_budget_s)


def prefill_replicas(
    model: DeploymentModel, load: ObservedLoad, slo: Slo, pool: str = "prefill"
) -> int:
    """Fewest P replicas whose M/M/c TTFT P90 meets the SLO at the target utilization
    (0 without traffic; the pool's max when even that cannot meet it)."""
    if load.rate_rps <= 0:
        return 0
    cached = load.input_tokens_mean * load.p_hit
    service = prefill_service_s(model.pools[pool], load.p_miss_tokens, cached)
    trip = first_token_trip_s(model, load)
    n = max(1, math.ceil(load.rate_rps * service / TARGET_UTILIZATION))
    for extra in range(4 * n + 64):
        estimate = ttft_p90_estimate(n + extra, load.rate_rps, service, trip, load.miss_scv)
        if estimate <= slo.ttft_p90_s:
            return n + extra
    return n + 4 * n + 64


def decode_batch(
    pool: PoolModel, context_tokens: float, reserved_tokens: float, itl_s: float
) -> int:
    """The largest batch whose step meets ``itl_s`` and whose reserved KV fits (0: none)."""
    fits = int(pool.shape.kv_capacity_tokens // max(1.0, reserved_tokens))
    best = 0
    for b in range(1, min(pool.max_batch, fits) + 1):
        if pool.shape.decode_seconds(b, b * context_tokens) > itl_s:
            break
        best = b
    return best


def decode_replicas(
    model: DeploymentModel, load: ObservedLoad, slo: Slo, pool: str = "main"
) -> int | None:
    """Fewest decode replicas carrying the output token rate at a step within the ITL
    target (None: even one sequence per step misses it, no replica count helps)."""
    if load.rate_rps <= 0:
        return 0
    pm = model.pools[pool]
    context = load.input_tokens_mean + load.output_tokens_mean / 2
    reserved = load.input_tokens_mean + load.output_tokens_mean
    batch = decode_batch(pm, context, reserved, slo.itl_p90_s * ITL_STEP_SHARE)
    if batch == 0:
        return None
    step = pm.shape.decode_seconds(batch, batch * context)
    tokens_per_s = load.rate_rps * load.output_tokens_mean
    return max(1, math.ceil(tokens_per_s * step / batch / TARGET_UTILIZATION))


def relay_replicas(model: DeploymentModel, load: ObservedLoad, pool: str = "relay") -> int:
    """Relays to hold every relayed request while its KV crosses (Little's law)."""
    relayed = load.rate_rps * load.relay_share
    if relayed <= 0:
        return 0
    hold = max(model.ttft_budget_s, model.line_seconds(load.md_miss_tokens))
    concurrency = relayed * hold
    return max(1, math.ceil(concurrency / model.pools[pool].max_batch / TARGET_UTILIZATION))


def line_gbps_needed(model: DeploymentModel, load: ObservedLoad) -> float:
    """The line rate that carries MD's misses at the sized utilization."""
    bits = load.rate_rps * load.md_miss_tokens * model.kv_bytes_per_token * 8
    return bits / 1e9 / LINE_UTILIZATION


def size(model: DeploymentModel, load: ObservedLoad, slo: Slo) -> dict[str, int | None]:
    """Replicas per pool of ``model`` (PDD: prefill, relay, main; same-DC: prefill,
    decode); None for a decode pool whose ITL target one sequence already misses."""
    out: dict[str, int | None] = {"prefill": prefill_replicas(model, load, slo)}
    for name in ("main", "decode"):
        if name in model.pools:
            out[name] = decode_replicas(model, load, slo, name)
    if "relay" in model.pools:
        out["relay"] = relay_replicas(model, load)
    return out
