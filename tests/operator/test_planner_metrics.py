"""The planner's reading of the router's and workers' metrics, and its decision, on
exposition text the real metrics modules render (RouterMetrics, WorkerMetrics): the
names the planner reads are the ones the components export."""

from __future__ import annotations

import math

import pytest

from pdd.operator.naming import Owner
from pdd.operator.planner import LINE_BOUND, line_condition, planner_for
from pdd.operator.planner_publish import PlannerMetrics
from pdd.operator.spec import PDDSpec
from pdd.router.metrics import RouterMetrics
from pdd.simulator.planner.model_file import load_model
from pdd.simulator.planner.scrape import (
    ROUTER,
    MetricsError,
    PlannerRound,
    PodMetrics,
    histogram_p90,
    increase,
    increases,
    observed_load,
    parse_exposition,
)
from pdd.worker.metrics import WorkerMetrics

pytestmark = pytest.mark.unit

SLO = {"ttftP90Seconds": 10, "itlP90Seconds": 0.08}


class Fleet:
    """A router and one worker per role, driven as traffic would drive them."""

    def __init__(self) -> None:
        self.router = RouterMetrics()
        self.workers = {role: WorkerMetrics(role) for role in ("prefill", "relay", "main")}

    def serve(self, n: int, pipeline: str, prompt: int, hit_p: int, hit_md: int, out: int,
              ttft_s: float) -> None:  # fmt: skip
        """``n`` requests of one kind, each as the router and its workers count it."""
        for _ in range(n):
            self.router.requests.labels(pipeline, "test").inc()
            self.router.tokens.labels("main").inc(out)
            self.router.ttft.observe(ttft_s)
            self.router.itl.observe(0.03)
            self.workers["prefill"].count_prompt(prompt, hit_p)
            if "MD" in pipeline:
                self.workers["main"].count_prompt(prompt, hit_md)

    def scrape(self) -> dict[str, PodMetrics]:
        pods = {"router-0": parse_exposition(self.router.render().decode(), "router-0", ROUTER)}
        for role, w in self.workers.items():
            pods[f"{role}-0"] = parse_exposition(w.render().decode(), f"{role}-0", role)
        return pods


def test_one_interval_of_traffic_becomes_the_load_the_planner_reads() -> None:
    fleet = Fleet()
    fleet.serve(10, "P-MD", 1000, 900, 950, 100, 1.5)  # before the interval: not counted
    queue = fleet.workers["prefill"].queue_time.labels("prefill")
    for _ in range(10):
        queue.observe(50.0)  # a queue that ended before the interval: not counted either
    before = fleet.scrape()
    fleet.serve(90, "P-MD", 1000, 900, 950, 100, 1.5)
    fleet.serve(30, "P-RLD-MD", 3000, 0, 2000, 100, 6.0)
    for wait in [0.002] * 90 + [3.0] * 30:
        queue.observe(wait)
    fleet.workers["prefill"].waiting.set(0)  # the gauge at the scrape's instant: not read
    fleet.router.link_goodput.labels("wan").set(12.5e9 / 8)
    load = observed_load(increases(before, fleet.scrape()), 60.0)
    assert load.rate_rps == pytest.approx(120 / 60)
    assert load.input_tokens_mean == pytest.approx((90 * 1000 + 30 * 3000) / 120)
    assert load.output_tokens_mean == pytest.approx(100)
    assert load.p_hit == pytest.approx(90 * 900 / (90 * 1000 + 30 * 3000))
    assert load.md_hit == pytest.approx((90 * 950 + 30 * 2000) / (90 * 1000 + 30 * 3000))
    assert load.relay_share == pytest.approx(30 / 120)
    # 25% waited 3 s: the P90 is inside the (2.5, 5] bucket, 18 of its 30 along
    assert load.prefill_queue_p90_s == pytest.approx(2.5 + 2.5 * 18 / 30)
    assert math.isnan(load.main_queue_p90_s)  # MD queued nothing: no queue time
    assert 5.0 < load.ttft_p90_s <= 10.0  # 25% of requests at 6 s: the P90 is in (5, 10]
    assert load.itl_p90_s == pytest.approx(0.025 + 0.025 * 0.9)
    assert load.wan_gbps == pytest.approx(12.5)


def test_without_mds_pods_its_hit_is_the_routers_estimate() -> None:
    """MD in cluster B, whose Role grants no pods: MD's hit from the router's index."""
    fleet = Fleet()
    before = fleet.scrape()
    fleet.serve(10, "P-MD", 1000, 900, 950, 100, 1.5)
    for ratio in (0.5, 1.0):
        fleet.router.prefix_hit_ratio.labels("main").observe(ratio)
    seen = {k: v for k, v in fleet.scrape().items() if v.role != "main"}
    assert observed_load(increases(before, seen), 60.0).md_hit == pytest.approx(0.75)


def test_a_restarted_or_new_pod_counts_from_zero_and_a_gauge_is_as_read() -> None:
    def pod(requests: float, waiting: float) -> PodMetrics:
        samples = {("pdd_router_requests_total", frozenset({("pipeline", "P-MD")})): requests,
                   ("pdd_worker_waiting_requests", frozenset()): waiting}  # fmt: skip
        return PodMetrics("p", ROUTER, samples)

    assert increase(pod(100, 3), pod(130, 5)).total("pdd_router_requests_total") == 30
    assert increase(pod(100, 3), pod(130, 5)).total("pdd_worker_waiting_requests") == 5
    assert increase(pod(100, 3), pod(7, 0)).total("pdd_router_requests_total") == 7  # restart
    assert increase(None, pod(7, 0)).total("pdd_router_requests_total") == 7  # new pod


def test_histogram_p90_interpolates_as_promql_and_caps_at_the_last_bound() -> None:
    router = RouterMetrics()
    pods = [parse_exposition(router.render().decode(), "r", ROUTER)]
    assert math.isnan(histogram_p90(pods, "pdd_router_ttft_seconds"))
    for _ in range(10):
        router.ttft.observe(40.0)  # past the last bucket (30 s)
    pods = [parse_exposition(router.render().decode(), "r", ROUTER)]
    assert histogram_p90(pods, "pdd_router_ttft_seconds") == 30.0


def test_an_idle_queue_reads_as_milliseconds_not_a_buckets_width() -> None:
    """Requests that never waited give a queue-time P90 far under any ``QUEUED`` share of
    a TTFT target: the buckets start at 1 ms, so interpolation cannot invent a queue."""
    worker = WorkerMetrics("prefill")
    before = parse_exposition(worker.render().decode(), "p", "prefill")
    for _ in range(100):
        worker.queue_time.labels("prefill").observe(0.0)
    after = parse_exposition(worker.render().decode(), "p", "prefill")
    p90 = histogram_p90([increase(before, after)], "pdd_worker_request_queue_time_seconds")
    assert p90 == pytest.approx(0.0009)


def test_text_that_is_not_prometheus_says_which_pod() -> None:
    with pytest.raises(MetricsError, match="pod router-0"):
        parse_exposition("pdd_router_requests_total{", "router-0", ROUTER)


def spec_with(pool_b_cr: dict, **planner: object) -> PDDSpec:
    spec = dict(pool_b_cr["spec"])
    spec["slo"], spec["planner"] = SLO, {"enabled": True, **planner}
    return PDDSpec.model_validate(spec)


def round_for(spec: PDDSpec) -> PlannerRound:
    model = load_model("published", spec.wan.declared_gbps, spec.wan.rtt_ms / 1000)
    return PlannerRound(planner_for(spec, model))


def test_the_planner_decides_on_the_interval_between_two_scrapes(pool_b_cr: dict) -> None:
    """First scrape: a baseline, no decision; a scrape with no router: no decision (no
    data is not zero load); then replicas per role within the spec's bounds, and more
    P for more low-hit traffic."""
    spec = spec_with(pool_b_cr, prefill={"minReplicas": 2, "maxReplicas": 40})
    fleet, loop = Fleet(), round_for(spec)
    assert loop.step(fleet.scrape(), 0.0) is None
    workers_only = {k: v for k, v in fleet.scrape().items() if v.role != ROUTER}
    assert loop.step(workers_only, 30.0) is None
    fleet.serve(600, "P-MD", 24000, 23000, 23500, 900, 1.0)
    light = loop.step(fleet.scrape(), 60.0)
    assert light is not None and set(light.replicas) == {"prefill", "relay", "main"}
    assert 2 <= light.replicas["prefill"] <= 40
    fleet.serve(600, "P-MD", 24000, 23000, 23500, 900, 1.0)
    fleet.serve(600, "P-MD", 24000, 0, 23500, 900, 1.0)  # a wave of new conversations
    heavy = loop.step(fleet.scrape(), 120.0)
    assert heavy is not None and heavy.replicas["prefill"] > light.replicas["prefill"]
    assert line_condition(heavy).type == LINE_BOUND


def test_a_line_too_slow_for_mds_misses_is_a_condition_not_a_replica_count(
    pool_b_cr: dict,
) -> None:
    spec = spec_with(pool_b_cr)
    fleet, loop = Fleet(), round_for(spec)
    fleet.router.link_goodput.labels("wan").set(1e9 / 8)  # the router measures 1 Gbit/s
    loop.step(fleet.scrape(), 0.0)
    fleet.serve(600, "P-MD", 24000, 0, 0, 900, 20.0)  # every token of KV crosses
    decision = loop.step(fleet.scrape(), 60.0)
    assert decision is not None and decision.line_bound
    condition = line_condition(decision)
    assert (condition.status, condition.reason) == ("True", "WanLineIsTheBottleneck")
    assert "1.0 Gbit/s as measured" in condition.message


def test_published_series_are_withdrawn_when_the_planner_stops(pool_b_cr: dict) -> None:
    spec = spec_with(pool_b_cr)
    fleet, loop = Fleet(), round_for(spec)
    loop.step(fleet.scrape(), 0.0)
    fleet.serve(100, "P-MD", 24000, 23000, 23500, 900, 1.0)
    decision = loop.step(fleet.scrape(), 60.0)
    assert decision is not None
    metrics, owner = PlannerMetrics(), Owner("qwen", "serving", "u")
    metrics.publish(owner, decision)
    labels = {"pdddeployment_namespace": "serving", "pdddeployment": "qwen", "role": "main"}
    value = metrics.registry.get_sample_value("pdd_planner_desired_replicas", labels)
    assert value == decision.replicas["main"]
    metrics.forget(owner)
    assert metrics.registry.get_sample_value("pdd_planner_desired_replicas", labels) is None
