"""The simulated day's pieces: scaling a cluster by drain, HPA damping, the day's shape,
the autoscaler's bookkeeping, and the per-window scoring."""

from __future__ import annotations

import math

import pytest

from pdd.common.vocabulary import Role
from pdd.local.traces.base import Chain, Trace, TraceRequest
from pdd.simulator.generator import GeneratorSpec
from pdd.simulator.lifecycle import RequestRecord
from pdd.simulator.planner.day import Autoscaler, Burst, DayShape, day_trace, fixed, windows
from pdd.simulator.planner.load import ObservedLoad, Slo
from pdd.simulator.planner.observe import observe
from pdd.simulator.planner.stabilize import Stabilizer
from pdd.simulator.queue_waits import QueueWaits
from pdd.simulator.runner import simulate
from pdd.simulator.scenario import Scenario, load_scenario

pytestmark = pytest.mark.unit

BLOCK = 512


def small(p: int = 2, relay: int = 1, main: int = 2) -> Scenario:
    s, _ = load_scenario("published")
    spec = s.systems["pdd"]
    counts = {"prefill": p, "relay": relay, "main": main}
    update = {n: getattr(spec, n).model_copy(update={"instances": c}) for n, c in counts.items()}
    run = s.run.model_copy(update={"warmup_s": 0.0, "drain_s": 600.0})
    return s.model_copy(update={"systems": {"pdd": spec.model_copy(update=update)}, "run": run})


def sessions(n: int, every_s: float, start: float = 0.0, blocks: int = 8) -> Trace[TraceRequest]:
    """``n`` one-turn conversations of ``blocks`` fresh blocks, ``every_s`` apart."""

    def turn(i: int) -> TraceRequest:
        ids = tuple(range(i * 1000, i * 1000 + blocks))
        return TraceRequest(f"c{i}#0", "t", ids, blocks * BLOCK, 200, BLOCK, 0.0)

    chains = tuple(Chain(f"c{i}", start + i * every_s, (turn(i),)) for i in range(n))
    return Trace("test", BLOCK, chains)


def test_scaling_down_drains_and_loses_nothing() -> None:
    """Retire all but one P and one MD while requests are in flight: every request still
    finishes, none is routed to a retired instance after its retirement."""
    retired_at: dict[str, float] = {}

    def shrink(env, cluster, records):
        yield env.timeout(5.0)
        for name in ("prefill", "main"):
            while len(cluster.pool(name)) > 1:
                before = set(cluster.retired)
                cluster.retire_instance(name)
                retired_at.update({i: env.now for i in set(cluster.retired) - before})

    holder = {}

    def keep(env, cluster, records):
        holder["c"] = cluster
        yield env.timeout(0)

    trace = sessions(30, 0.1, start=4.0, blocks=40)
    run = simulate(small(4, 1, 4), "pdd", trace, None, [shrink, keep])
    assert len(retired_at) == 6
    assert all(not math.isnan(r.finish) and not r.lost for r in run.records)
    fleet = holder["c"].fleet
    for role in (Role.PREFILL, Role.MAIN):
        assert not set(fleet.role(role).ids()) & set(retired_at)  # the router never sees them
    assert any(holder["c"].by_id[i].stats.tokens > 0 for i in retired_at)  # they had work


def test_scaling_up_adds_cold_instances_the_router_uses() -> None:
    def grow(env, cluster, records):
        yield env.timeout(1.0)
        cluster.add_instance("prefill")
        cluster.add_instance("main")

    cluster_seen = {}

    def keep(env, cluster, records):
        cluster_seen["c"] = cluster
        yield env.timeout(0)

    simulate(small(1, 1, 1), "pdd", sessions(60, 0.001, start=2.0, blocks=64), None, [grow, keep])
    c = cluster_seen["c"]
    assert [i.instance_id for i in c.prefill] == ["p0", "p1"]
    assert c.prefill[1].stats.steps > 0 and c.main[1].stats.tokens > 0


def test_one_instance_is_never_retired() -> None:
    def shrink(env, cluster, records):
        yield env.timeout(1.0)
        cluster.retire_instance("relay")

    holder = {}

    def keep(env, cluster, records):
        holder["c"] = cluster
        yield env.timeout(0)

    simulate(small(1, 1, 1), "pdd", sessions(4, 1.0), None, [shrink, keep])
    assert len(holder["c"].relay) == 1 and not holder["c"].retired


def test_stabilizer_scales_up_at_once_and_down_after_the_window() -> None:
    s = Stabilizer(300)
    assert [s(0, 5), s(60, 2), s(299, 2), s(301, 2), s(400, 9)] == [5, 5, 5, 2, 9]


def test_the_day_varies_by_its_ratio_and_bursts_multiply() -> None:
    shape = DayShape(ratio=5.0, peak_h=16.0, bursts=(Burst(7.0, 10, 2.0),))
    assert shape.level(16 * 3600) == pytest.approx(1.0)
    assert shape.level(4 * 3600) == pytest.approx(0.2)
    assert shape.level(7 * 3600 + 60) == pytest.approx(2 * shape.level(7 * 3600 - 1), rel=0.01)


def test_thinning_keeps_sessions_by_the_level_at_their_start() -> None:
    spec = GeneratorSpec(rate_rps=2.0, mean_turns=4, mean_think_s=5, expected_answer_s=5,
                         input_median_tokens=2048, input_p90_tokens=4096, seed=3)  # fmt: skip
    full = spec.model_copy(update={"duration_s": 4000.0}).build()
    half = day_trace(spec, DayShape(ratio=1.0, bursts=()), 4000.0)
    assert len(half.chains) == len(full.chains)
    flat = DayShape(ratio=4.0, peak_h=0.0, bursts=())
    thinned = day_trace(spec, flat, 4000.0)
    assert 0 < len(thinned.chains) < len(full.chains)


def test_the_autoscaler_bills_starting_live_and_draining_instances() -> None:
    """Fixed at 2/1/2 from 1/1/1: the extra P and MD cost from the request to start,
    and GPU-hours are the instance count times the time."""
    scaler = Autoscaler(fixed({"prefill": 2, "relay": 1, "main": 2}), interval_s=60,
                        startup_s=120)  # fmt: skip
    run = simulate(small(1, 1, 1), "pdd", sessions(4, 1.0), 600.0, [scaler])
    intervals = int(run.horizon_s // 60)
    assert scaler.gpu_hours == pytest.approx(3 / 60 + (intervals - 1) * 5 / 60)
    assert scaler.timeline[1]["prefill"] == 1 and scaler.timeline[2]["prefill"] == 2


def test_windows_score_client_ttft_p90_with_unanswered_requests() -> None:
    slo = Slo(2.0, 0.1)

    def rec(t: float, ttft: float) -> RequestRecord:
        r = RequestRecord("k", t, 10, 10)
        r.first_token, r.finish = t + ttft, t + ttft + 0.5
        return r

    ok = [rec(float(i), 1.0) for i in range(10)]
    late = [rec(300.0 + i, 1.0) for i in range(8)] + [RequestRecord("x", 301.0, 10, 10)] * 2
    out = windows(ok + late, slo, horizon=1000.0)
    assert [w["met"] for w in out] == [True, False]
    assert out[1]["ttft_p90_s"] == pytest.approx(699.0)


def test_the_observation_reads_each_pools_queue_time_over_the_interval() -> None:
    """The day's planner reads queue time as the live one scrapes it: the P90 of the
    waits that ended in the interval, from each instance's own queue. A burst of prompts
    on one P queues at P; the interval after it drained reads no waits at all (a gauge
    read then would have said the same of the burst if it had drained by then)."""
    seen: dict[float, ObservedLoad] = {}

    def watch(env, cluster, records):
        for _ in range(6):
            yield env.timeout(5.0)
            seen[env.now] = observe(cluster, records, env.now, 5.0)

    simulate(small(1, 1, 2), "pdd", sessions(20, 0.001, start=1.0, blocks=16), 30.0, [watch])
    burst, after = seen[5.0], seen[10.0]  # 20 prompts at once: the last wait ends after 5 s
    assert burst.prefill_queue_p90_s > 1.0 and burst.main_queue_p90_s < 0.01
    assert after.rate_rps == 0 and after.prefill_queue_p90_s > burst.prefill_queue_p90_s
    assert math.isnan(seen[30.0].prefill_queue_p90_s)  # drained: no wait ended


def test_queue_waits_are_read_by_when_they_ended() -> None:
    waits = QueueWaits()
    for ended, wait in ((1.0, 0.5), (2.0, 3.0), (4.0, 0.1)):
        waits.record(ended, wait)
    assert waits.ended_in(1.5, 4.0) == [3.0] and waits.ended_in(0.0, 10.0) == [0.5, 3.0, 0.1]
