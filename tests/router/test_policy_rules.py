"""The pipeline rules as one table: the rule that fires gives the pipeline, the
``x-pdd-reason`` text and the metric label, and the policy's docstring lists the table."""

import random
import re
from dataclasses import replace

import pytest

from pdd.common.cost_model import LinkState
from pdd.common.vocabulary import Pipeline, Role
from pdd.router import policy
from pdd.router.fleet import Fleet
from pdd.router.instance_choice import InstanceLoad
from pdd.router.link_view import LinkView
from pdd.router.policy import Decision, PolicyConfig, RequestFeatures, Saturated, decide
from pdd.router.policy_rules import RULES, Rule
from pdd.router.recent_traffic import TrafficWindow

pytestmark = pytest.mark.unit

KVB = 50_000
CONFIG = PolicyConfig(kv_bytes_per_token=KVB, idle_relay_min_transfer_s=None)
IDLE = replace(CONFIG, idle_relay_min_transfer_s=0.1)
CODECS = (("none", KVB), ("int8", KVB // 2), ("int4", KVB // 4))
SLOW = LinkState(declared_gbps=10, rtt_ms=30)
QUIET = TrafficWindow(window_s=60, requests=1000)
CAPPED = TrafficWindow(window_s=60, requests=99, relay_only_requests=5)
DOUBT = "the WAN line is suspected_cut (p0 could not send the KV to md0)"


def fleet(md=True, rld=0):
    """One P, one MD (or none), one relay with ``rld`` of 8 slots taken (None: no relay)."""
    loads = [InstanceLoad("p0", Role.PREFILL, 0, 8)]
    if md:
        loads.append(InstanceLoad("md0", Role.MAIN, 0, 8))
    if rld is not None:
        loads.append(InstanceLoad("rld0", Role.RELAY, rld, 8))
    return Fleet.of(loads)


def req(n, output=2000):
    return RequestFeatures(n, output, 1)


#: Why vLLM could not resume a request (``RequestFeatures.vllm_resume_refusal``).
UNRESUMABLE = "a seeded request at temperature > 0"
ON_VLLM = {"md0": "vllm"}

#: One request per rule that the rule decides; the keys must be every rule's code.
SCENARIOS = {
    "vllm_one_sampler": dict(
        request=replace(req(64_000), vllm_resume_refusal=UNRESUMABLE), engines=ON_VLLM
    ),
    "retry": dict(request=req(500), retry=True),
    "retry_no_main_decode": dict(request=req(500), fleet=fleet(md=False), retry=True),
    "idle_relay": dict(request=req(4000), hits={"p0": 3500}, config=IDLE),
    "anomalous": dict(request=req(100_000, output=100)),
    "anomalous_capped": dict(request=req(100_000, output=100), traffic=CAPPED),
    "transfer_exceeds_budget": dict(request=req(64_000)),
    "link_doubted": dict(request=req(500), view=LinkView(SLOW, doubt=DOUBT)),
    "link_doubted_relays_saturated": dict(
        request=req(500), fleet=fleet(rld=8), view=LinkView(SLOW, doubt=DOUBT)
    ),
    "fits_ttft_budget": dict(request=req(500)),
    "relays_saturated": dict(request=req(64_000), fleet=fleet(rld=8)),
    "relay_not_sooner": dict(
        request=req(64_000),
        hits={"p0": 60_000, "md0": 4_000},
        fleet=fleet(rld=4),
        view=LinkView(SLOW, relay_slot_s=0.6),
    ),
}
PLAIN, UNDOUBTED = fleet(), LinkView(SLOW)


def run(request, hits=None, fleet=PLAIN, view=UNDOUBTED, traffic=QUIET, config=CONFIG,
        retry=False, engines=None):  # fmt: skip
    return decide(request, hits or {}, fleet, view, traffic, config, retry, engines)


def pattern(rule: Rule) -> re.Pattern[str]:
    """The rule's reason template with each field a wildcard: what its text must match."""
    return re.compile(re.sub(r"\\\{[^}]*\\\}", ".+", re.escape(rule.reason)))


def test_the_docstring_lists_the_rule_table_in_order():
    listed = [line for line in policy.__doc__.splitlines() if line.startswith("- ``")]
    assert listed == [rule.doc_line() for rule in RULES]


def test_each_rule_has_its_own_code():
    codes = [rule.code for rule in RULES]
    assert len(set(codes)) == len(codes)


def test_every_rule_has_a_case_it_decides():
    assert set(SCENARIOS) == {rule.code for rule in RULES}


@pytest.mark.parametrize("code", list(SCENARIOS))
def test_the_rule_that_fires_gives_pipeline_reason_and_label(code):
    d = run(**SCENARIOS[code])
    assert isinstance(d, Decision) and d.rule.code == code
    assert d.pipeline == d.rule.pipeline
    assert pattern(d.rule).match(d.reason), d.reason


def test_a_relayed_kv_coded_to_fit_a_congested_line_is_labelled_as_relayed():
    """A relay serves the first token (the exact KV misses the budget); on a congested
    line MD's KV is coded and its estimate then fits. The label is the rule that relayed
    it, not ``idle_relay`` (which the old label, derived from the final estimate, said)."""
    backlog = int(2.1 * 3.0e9 / 8)
    link = LinkState(declared_gbps=3.0, rtt_ms=30, backlog_bytes=backlog, backlog_transfers=1)
    config = replace(CONFIG, adaptive_codecs=CODECS, md_recompute_max_tokens=0)
    d = run(req(22_000), {"p0": 20_000, "md0": 2_000}, view=LinkView(link), config=config)
    assert d.pipeline == Pipeline.P_RLD_MD and d.estimate.kv_codec == "int4"
    assert d.estimate.md_first_token_s <= config.ttft_budget_s
    assert d.rule.code == "transfer_exceeds_budget" and "exceeds" in d.reason


def test_md_computing_to_fit_keeps_the_label_of_the_rule_that_chose_p_md():
    """Every relay saturated and the exact KV over budget: P-MD, and MD computes the miss
    in time. The label says why P-MD served (``relays_saturated``), as the text does."""
    link, tight = LinkState(declared_gbps=1.0, rtt_ms=30), replace(CONFIG, ttft_budget_s=1.0)
    d = run(req(64_000), {"p0": 62_000, "md0": 60_000}, fleet=fleet(rld=8), view=LinkView(link),
            config=tight)  # fmt: skip
    assert d.pipeline == Pipeline.P_MD and d.estimate.md_computes_miss
    assert d.estimate.md_first_token_s <= tight.ttft_budget_s
    assert d.rule.code == "relays_saturated" and "every relay is saturated" in d.reason


def test_a_doubted_line_relaying_over_budget_is_labelled_link_doubted():
    """Over budget and the relay's queue outlasts the wait (P-MD), but the line is in
    doubt: relayed for the doubt, and labelled so, as the text says."""
    view = LinkView(SLOW, doubt=DOUBT, relay_slot_s=0.6)
    d = run(req(64_000), {"p0": 60_000, "md0": 4_000}, fleet=fleet(rld=4), view=view)
    assert d.pipeline == Pipeline.P_RLD_MD
    assert d.rule.code == "link_doubted" and d.reason.startswith(DOUBT)


def _random_case(rng: random.Random) -> dict:
    n = rng.choice([500, 4000, 22_000, 64_000, 100_000])
    link = LinkState(declared_gbps=rng.choice([0.5, 3.0, 10.0, 100.0]), rtt_ms=30,
                     backlog_bytes=rng.choice([0, 10**9]), backlog_transfers=1)  # fmt: skip
    config = replace(
        CONFIG, ttft_budget_s=rng.choice([0.5, 2.0]),
        idle_relay_min_transfer_s=rng.choice([None, 0.05]),
        adaptive_codecs=rng.choice([(), CODECS]), md_recompute_max_tokens=rng.choice([0, 4096]),
    )  # fmt: skip
    refusal = UNRESUMABLE if rng.random() < 0.1 else None
    return dict(
        request=replace(req(n, output=rng.choice([None, 100, 2000])), vllm_resume_refusal=refusal),
        hits={"p0": rng.randrange(n + 1), "md0": rng.randrange(n + 1)},
        fleet=fleet(md=rng.random() < 0.8, rld=rng.choice([None, 0, 1, 4, 8])),
        view=LinkView(link, doubt=rng.choice([None, DOUBT]), relay_slot_s=rng.choice([0, 0.6])),
        traffic=rng.choice([QUIET, CAPPED]),
        config=config,
        retry=rng.random() < 0.2,
        engines=rng.choice([None, ON_VLLM]),
    )


def test_some_rule_fires_for_every_request_and_its_text_leads_the_reason():
    """Over a spread of requests, fleets and lines: the table always has a rule that
    fires, its pipeline serves, its reason text leads the reason, and every rule fires."""
    rng, fired = random.Random(57), set()
    for _ in range(2000):
        d = run(**_random_case(rng))
        if isinstance(d, Saturated):
            continue
        fired.add(d.rule.code)
        assert d.pipeline == d.rule.pipeline
        assert pattern(d.rule).match(d.reason), d.reason
    assert fired == {rule.code for rule in RULES}
