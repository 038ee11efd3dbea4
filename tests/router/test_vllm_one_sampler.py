"""Rule ``vllm_one_sampler``: a request whose sampling vLLM cannot resume after a handoff
(a seeded draw at temperature > 0) goes P-MD with MD computing its whole miss wherever a
vLLM instance is on its route, so one instance samples every token; everything else is
routed as before. The policy on crafted cases, then the router's own registry polling
scripted workers whose ``/health`` names their engine, through ``Dispatcher.attempt``
(the plan the workers get).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdd.common.cost_model import LinkState
from pdd.common.vocabulary import Pipeline, Role
from pdd.common.wire import SamplingSpec
from pdd.router.fleet import Fleet
from pdd.router.instance_choice import InstanceLoad
from pdd.router.link_view import LinkView
from pdd.router.policy import Decision, PolicyConfig, RequestFeatures, decide
from pdd.router.recent_traffic import TrafficWindow
from pdd.testing.scripted_worker import ScriptedWorkers, engine_info

pytestmark = pytest.mark.unit

CONFIG = PolicyConfig(kv_bytes_per_token=50_000, idle_relay_min_transfer_s=None)
SLOW = LinkState(declared_gbps=10, rtt_ms=30)
QUIET = TrafficWindow(window_s=60, requests=1000)
SEEDED = SamplingSpec(temperature=0.8, seed=11, max_tokens=64)
FLEET = Fleet.of(
    [
        InstanceLoad("p0", Role.PREFILL, 0, 8),
        InstanceLoad("md0", Role.MAIN, 0, 8),
        InstanceLoad("rld0", Role.RELAY, 0, 8),
    ]
)
ALL_VLLM = {"p0": "vllm", "md0": "vllm", "rld0": "vllm"}


def features(input_tokens: int, sampling: SamplingSpec | None) -> RequestFeatures:
    return RequestFeatures.from_prompt(list(range(input_tokens)), 64, 16, sampling)


def run(request: RequestFeatures, hits: dict[str, int], engines: dict[str, str]) -> Decision:
    d = decide(request, hits, FLEET, LinkView(SLOW), QUIET, CONFIG, engines=engines)
    assert isinstance(d, Decision)
    return d


#: (prompt tokens, hits): a relayed request (its KV lags on the slow line), and a P-MD one
#: whose miss is far over ``md_recompute_max_tokens``.
CASES = [(64_000, {"p0": 60_000, "md0": 1_000}), (64_000, {"p0": 63_000, "md0": 32_000})]


@pytest.mark.parametrize(("n", "hits"), CASES)
def test_a_seeded_request_on_vllm_is_sampled_by_md_alone(n: int, hits: dict[str, int]) -> None:
    d = run(features(n, SEEDED), hits, ALL_VLLM)
    assert d.rule.code == "vllm_one_sampler" and d.pipeline == Pipeline.P_MD
    assert d.instances.relay is None and d.instances.main_decode == "md0"
    assert d.estimate.md_computes_miss  # P computes nothing: no handoff at all
    assert d.estimate.md_hit_tokens == hits["md0"]
    assert "seeded" in d.reason and "one instance samples every token" in d.reason


@pytest.mark.parametrize("on_vllm", ["p0", "md0", "rld0"])
def test_any_vllm_instance_on_the_route_is_enough(on_vllm: str) -> None:
    n, hits = CASES[0]
    d = run(features(n, SEEDED), hits, {on_vllm: "vllm"})
    assert d.rule.code == "vllm_one_sampler" and on_vllm in d.reason


@pytest.mark.parametrize(("n", "hits"), CASES)
@pytest.mark.parametrize(
    ("sampling", "engines"),
    [
        (SEEDED, {}),  # the pdd engine resumes a seeded draw exactly
        (SEEDED, {"p0": "pdd", "md0": "pdd", "rld0": "pdd"}),
        (SamplingSpec(temperature=0.8, max_tokens=64), ALL_VLLM),  # no seed: nothing promised
        (SamplingSpec(seed=11, max_tokens=64), ALL_VLLM),  # greedy
        (SamplingSpec(presence_penalty=0.5, min_tokens=4, max_tokens=64), ALL_VLLM),  # carried
        (None, ALL_VLLM),
    ],
)
def test_requests_a_handoff_serves_are_routed_as_before(
    n: int, hits: dict[str, int], sampling: SamplingSpec | None, engines: dict[str, str]
) -> None:
    before = run(features(n, None), hits, {})
    assert run(features(n, sampling), hits, engines) == before
    assert before.rule.code != "vllm_one_sampler"


def test_without_an_md_the_rule_does_not_fire() -> None:
    no_md = Fleet.of(
        [InstanceLoad("p0", Role.PREFILL, 0, 8), InstanceLoad("rld0", Role.RELAY, 0, 8)]
    )
    request = replace(features(100_000, SEEDED), expected_output_tokens=64)
    d = decide(request, {}, no_md, LinkView(SLOW), QUIET, CONFIG, engines=ALL_VLLM)
    assert isinstance(d, Decision) and d.rule.code != "vllm_one_sampler"


TOPOLOGY = {"p": Role.PREFILL, "rld": Role.RELAY, "md": Role.MAIN}


@pytest.mark.parametrize("engine", ["vllm", "pdd"])
async def test_the_router_reads_each_workers_engine_and_plans_md_prefilling(engine: str) -> None:
    """Through the router's own registry, polls and plan: on vLLM workers the seeded
    request's plan has MD prefill (``md_prefills``) and names the rule; on pdd engine
    workers the same request takes the route an unseeded one does."""
    engines = {name: engine_info(engine=engine) for name in TOPOLOGY}  # type: ignore[arg-type]
    runtime = ScriptedWorkers(TOPOLOGY, engines).router()
    try:
        await runtime.registry.poll_once()
        assert runtime.ready()
        prompt = list(range(40))
        seeded = await runtime.dispatcher.attempt(prompt, SEEDED, request_id="r1")
        plain = SamplingSpec(temperature=0.8, max_tokens=64)
        unseeded = await runtime.dispatcher.attempt(prompt, plain, request_id="r2")
        for attempt in (seeded, unseeded):
            attempt.lease.release_all()
        assert unseeded.route.reason_code != "vllm_one_sampler"
        if engine == "vllm":
            assert seeded.route.reason_code == "vllm_one_sampler"
            assert seeded.route.pipeline == Pipeline.P_MD and seeded.plan.md_prefills
            assert "seeded" in seeded.route.reason
        else:
            assert seeded.route.reason_code == unseeded.route.reason_code
            assert seeded.route.pipeline == unseeded.route.pipeline
    finally:
        await runtime.close()
