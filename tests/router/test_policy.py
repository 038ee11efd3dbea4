"""The pipeline policy on crafted cases, with thresholds taken from the cost model."""

from dataclasses import replace

import pytest

from pdd.common.block_hash import block_hashes
from pdd.common.cost_model import LinkState, pmd_first_token_seconds, wan_transfer_seconds
from pdd.common.kv_codec import MD_RECOMPUTE_MAX_TOKENS
from pdd.common.vocabulary import Pipeline, Role
from pdd.router.fleet import Fleet
from pdd.router.instance_choice import InstanceLoad
from pdd.router.link_view import LinkView
from pdd.router.policy import (
    Assignment,
    Decision,
    PolicyConfig,
    RequestFeatures,
    Saturated,
    decide,
)
from pdd.router.recent_traffic import TrafficWindow

pytestmark = pytest.mark.unit

KVB = 50_000
#: The budget rules alone; the idle-relay rule has its own tests at the end.
CONFIG = PolicyConfig(
    kv_bytes_per_token=KVB,
    ttft_budget_s=2.0,
    prefill_tokens_per_s=10_000,
    idle_relay_min_transfer_s=None,
)
FAST = LinkState(declared_gbps=100, rtt_ms=30)
SLOW = LinkState(declared_gbps=10, rtt_ms=30)
QUIET = TrafficWindow(window_s=60, requests=1000)  # plenty of room under the P-RLD cap


def fleet(p=("p0", 0, 8), md=("md0", 0, 8), rld=("rld0", 0, 8)):
    return Fleet.of(
        [
            InstanceLoad(p[0], Role.PREFILL, p[1], p[2]),
            InstanceLoad(md[0], Role.MAIN, md[1], md[2]),
            InstanceLoad(rld[0], Role.RELAY, rld[1], rld[2]),
        ]
    )


def req(input_tokens, output=2000, key=1):
    return RequestFeatures(input_tokens, output, key)


def run(request, hits, link=SLOW, instances=None, traffic=QUIET, config=CONFIG):
    return decide(request, hits, instances or fleet(), LinkView(link), traffic, config)


def test_high_hit_goes_p_md():
    d = run(req(64_000), {"p0": 63_000, "md0": 62_000})
    assert isinstance(d, Decision)
    assert d.pipeline == Pipeline.P_MD
    assert d.instances.prefill == "p0" and d.instances.main_decode == "md0"
    assert d.instances.relay is None
    assert "fits" in d.reason
    assert d.estimate.md_hit_tokens == 62_000
    assert d.estimate.transfer_s == pytest.approx(wan_transfer_seconds(2_000, KVB, SLOW))


def test_low_hit_on_slow_link_relays():
    d = run(req(64_000), {"p0": 60_000, "md0": 1_000})
    assert d.pipeline == Pipeline.P_RLD_MD
    assert d.instances == type(d.instances)("p0", "md0", "rld0")
    assert "exceeds" in d.reason


def test_long_input_short_output_goes_p_rld():
    d = run(req(100_000, output=200), {})
    assert d.pipeline == Pipeline.P_RLD
    assert d.instances.main_decode is None and d.instances.relay == "rld0"
    assert "anomalous" in d.reason


def test_long_input_unknown_output_is_not_anomalous():
    d = run(req(100_000, output=None), {})
    assert d.pipeline == Pipeline.P_RLD_MD


def test_output_threshold_is_exclusive():
    assert run(req(100_000, output=499), {}).pipeline == Pipeline.P_RLD
    assert run(req(100_000, output=500), {}).pipeline == Pipeline.P_RLD_MD


def test_anomalous_but_cheap_transfer_stays_on_md():
    """A long prompt MD already holds keeps the conversation on MD: nothing to save."""
    d = run(req(100_000, output=100), {"p0": 99_000, "md0": 99_000})
    assert d.pipeline == Pipeline.P_MD


def test_relays_saturated_falls_back_to_p_md_with_reason():
    d = run(req(64_000), {"md0": 1_000}, instances=fleet(rld=("rld0", 8, 8)))
    assert d.pipeline == Pipeline.P_MD
    assert d.instances.relay is None
    assert "every relay is saturated" in d.reason


def test_relays_saturated_blocks_p_rld_too():
    d = run(req(100_000, output=100), {}, instances=fleet(rld=("rld0", 8, 8)))
    assert d.pipeline == Pipeline.P_MD


def _threshold_gbps(input_tokens, p_hit, md_hit, rtt_ms, config=CONFIG):
    """Bandwidth at which MD's first token (one RTT + the longer of the prefill and the
    serialization: P streams KV as it prefills) exactly equals the budget, per the cost
    model, where the serialization is the longer."""
    prefill_s = (input_tokens - p_hit) / config.prefill_tokens_per_s
    wire_s = config.ttft_budget_s - rtt_ms / 1000
    assert wire_s > prefill_s
    bits = (input_tokens - md_hit) * config.kv_bytes_per_token * 8
    return bits / (wire_s * 1e9)


@pytest.mark.parametrize("measured", [False, True])
def test_bandwidth_change_flips_exactly_at_cost_model_threshold(measured):
    hits = {"p0": 50_000, "md0": 20_000}
    g = _threshold_gbps(64_000, 50_000, 20_000, rtt_ms=30)
    assert 5 < g < 100  # a realistic crossing point, not a degenerate one

    def link(gbps):
        if measured:  # measured goodput overrides a generous declaration
            return LinkState(declared_gbps=400, rtt_ms=30, measured_goodput_gbps=gbps)
        return LinkState(declared_gbps=gbps, rtt_ms=30)

    assert run(req(64_000), hits, link=link(g * 1.001)).pipeline == Pipeline.P_MD
    assert run(req(64_000), hits, link=link(g * 0.999)).pipeline == Pipeline.P_RLD_MD


def test_ttft_budget_change_flips_at_cost_model_eta():
    hits = {"p0": 50_000, "md0": 40_000}
    eta = pmd_first_token_seconds(1.4, wan_transfer_seconds(24_000, KVB, FAST), FAST.rtt_s)
    assert eta == pytest.approx(0.03 + 1.4)  # the prefill paces the streamed KV
    tight = replace(CONFIG, ttft_budget_s=eta * 0.999)
    loose = replace(CONFIG, ttft_budget_s=eta * 1.001)
    assert run(req(64_000), hits, link=FAST, config=tight).pipeline == Pipeline.P_RLD_MD
    assert run(req(64_000), hits, link=FAST, config=loose).pipeline == Pipeline.P_MD


def test_share_cap_holds():
    at_cap = TrafficWindow(window_s=60, requests=99, relay_only_requests=5)
    under = TrafficWindow(window_s=60, requests=99, relay_only_requests=4)
    d = run(req(100_000, output=100), {}, traffic=at_cap)
    assert d.pipeline == Pipeline.P_RLD_MD
    assert "cap" in d.reason
    assert run(req(100_000, output=100), {}, traffic=under).pipeline == Pipeline.P_RLD


def test_share_cap_on_a_cold_router_admits_no_relay_only():
    """With no history, one P-RLD request would be 100% of traffic: refused."""
    d = run(req(100_000, output=100), {}, traffic=TrafficWindow(window_s=60))
    assert d.pipeline == Pipeline.P_RLD_MD


def test_share_cap_over_a_stream_of_anomalous_requests():
    """Even if every request were anomalous, P-RLD never exceeds its share."""
    relay_only = total = 0
    for _ in range(400):
        window = TrafficWindow(window_s=60, requests=total, relay_only_requests=relay_only)
        d = run(req(100_000, output=100), {}, traffic=window)
        relay_only += d.pipeline == Pipeline.P_RLD
        total += 1
    assert 0 < relay_only <= CONFIG.relay_only_max_share * total


def test_token_rate_cap_holds():
    config = PolicyConfig(
        kv_bytes_per_token=KVB, relay_only_max_share=1.0, relay_only_max_tokens_per_s=2_000
    )
    busy = TrafficWindow(
        window_s=60, requests=10, relay_only_requests=0, relay_only_input_tokens=30_000
    )
    # (30_000 + 100_000) / 60 s = 2_167 tokens/s > 2_000
    d = run(req(100_000, output=100), {}, traffic=busy, config=config)
    assert d.pipeline == Pipeline.P_RLD_MD and "tokens/s" in d.reason
    calm = TrafficWindow(window_s=60, requests=10, relay_only_input_tokens=10_000)
    assert run(req(100_000, output=100), {}, traffic=calm, config=config).pipeline == Pipeline.P_RLD


def test_no_prefill_capacity_is_saturated():
    d = run(req(1_000), {}, instances=fleet(p=("p0", 8, 8)))
    assert isinstance(d, Saturated)
    assert d.retry_after_s == CONFIG.retry_after_s
    assert "prefill" in d.reason


def test_no_main_decode_capacity_is_saturated():
    d = run(req(1_000), {}, instances=fleet(md=("md0", 8, 8)))
    assert isinstance(d, Saturated) and "main-decode" in d.reason


def test_no_main_decode_still_serves_anomalous_on_relay():
    d = run(req(100_000, output=100), {}, instances=fleet(md=("md0", 8, 8)))
    assert isinstance(d, Decision) and d.pipeline == Pipeline.P_RLD


def test_short_prompt_on_any_link_is_p_md():
    assert run(req(500), {}).pipeline == Pipeline.P_MD


def test_hits_beyond_input_are_clamped():
    d = run(req(1_000), {"p0": 5_000, "md0": 5_000})
    assert d.estimate.p_hit_tokens == d.estimate.md_hit_tokens == 1_000
    assert d.estimate.prefill_s == 0


def test_config_validates():
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        PolicyConfig(kv_bytes_per_token=0)
    with pytest.raises(ValueError, match="relay_only_max_share"):
        PolicyConfig(kv_bytes_per_token=1, relay_only_max_share=2)


def test_features_from_prompt_key_is_the_first_block_hash():
    tokens = list(range(40))
    f = RequestFeatures.from_prompt(tokens, 100, block_size=16)
    assert f.input_tokens == 40 and f.expected_output_tokens == 100
    assert f.affinity_key == block_hashes(tokens, 16)[0]
    # Same first block, different later turns: same key (the conversation's turns).
    assert RequestFeatures.from_prompt([*tokens, 1, 2], None, 16).affinity_key == f.affinity_key
    short = RequestFeatures.from_prompt([1, 2, 3], None, 16)
    assert short.affinity_key != RequestFeatures.from_prompt([1, 2, 4], None, 16).affinity_key


def test_kv_already_on_the_line_sends_the_next_request_to_a_relay():
    """Alone, this request's miss crosses in time (P-MD); behind four transfers the router
    dispatched and has not seen land, queueing behind their KV, it does not (P-RLD-MD)."""
    request, hits = req(64_000), {"p0": 63_000, "md0": 50_000}
    alone = run(request, hits)
    assert isinstance(alone, Decision) and alone.pipeline == Pipeline.P_MD
    backlog = 4 * 14_000 * KVB  # four transfers larger than this one's miss
    queued = run(request, hits, link=replace(SLOW, backlog_bytes=backlog, backlog_transfers=4))
    assert isinstance(queued, Decision) and queued.pipeline == Pipeline.P_RLD_MD
    assert queued.estimate.transfer_s > CONFIG.ttft_budget_s


def test_routes_that_ship_kv_count_on_the_link_until_md_has_it():
    from pdd.common.wire import Endpoint
    from pdd.router.route import WAN_BACKLOG_KIB, WAN_TRANSFERS, Route, md_pending_key

    def ep(name):
        return Endpoint(
            instance_id=name, http_url=f"http://{name}", fast_addr=f"{name}:1", wan_addr=f"{name}:2"
        )

    p_md = Route(
        Pipeline.P_MD, "r", "c", prefill=ep("p0"), relay=None, main=ep("md0"), kv_bytes=2049
    )
    # MD counts it as pending until its first token (it waits at P till then)
    assert p_md.lease_keys == ["p0", md_pending_key("md0"), WAN_TRANSFERS, WAN_BACKLOG_KIB]
    assert p_md.lease_amounts == {WAN_BACKLOG_KIB: 3}  # KiB, rounded up
    mono = Route(Pipeline.MONO, "r", "c", prefill=None, relay=None, main=ep("m0"))
    assert mono.lease_keys == ["m0"]


def test_a_retry_keeps_a_relay_on_the_route_even_when_md_would_be_in_time():
    assert run(req(500), {}).pipeline == Pipeline.P_MD
    d = decide(req(500), {}, fleet(), LinkView(SLOW), QUIET, CONFIG, retry=True)
    assert isinstance(d, Decision) and d.pipeline == Pipeline.P_RLD_MD
    assert (d.instances.relay, d.instances.main_decode) == ("rld0", "md0")
    assert "retry" in d.reason


def test_a_retry_with_no_main_decode_left_ends_on_the_relay():
    no_md = Fleet.of(
        [InstanceLoad("p0", Role.PREFILL, 0, 8), InstanceLoad("rld0", Role.RELAY, 0, 8)]
    )
    d = decide(req(500), {}, no_md, LinkView(SLOW), QUIET, CONFIG, retry=True)
    assert isinstance(d, Decision) and d.pipeline == Pipeline.P_RLD
    assert d.instances == Assignment(prefill="p0", main_decode=None, relay="rld0")


def test_a_retry_with_every_relay_full_follows_the_usual_rules():
    full = fleet(rld=("rld0", 8, 8))
    d = decide(req(500), {}, full, LinkView(SLOW), QUIET, CONFIG, retry=True)
    assert d.pipeline == Pipeline.P_MD


DOUBT = "the WAN line is suspected_cut (p0 could not send the KV to md0)"


def test_a_doubted_line_puts_a_relay_on_what_would_be_p_md():
    d = decide(req(500), {}, fleet(), LinkView(SLOW, doubt=DOUBT), QUIET, CONFIG)
    assert isinstance(d, Decision) and d.pipeline == Pipeline.P_RLD_MD
    assert (d.instances.relay, d.instances.main_decode) == ("rld0", "md0")
    assert DOUBT in d.reason
    assert d.rule.code == "link_doubted"


def test_a_doubted_line_with_every_relay_full_still_serves_p_md():
    full = fleet(rld=("rld0", 8, 8))
    d = decide(req(500), {}, full, LinkView(SLOW, doubt=DOUBT), QUIET, CONFIG)
    assert isinstance(d, Decision) and d.pipeline == Pipeline.P_MD
    assert "saturated" in d.reason


def test_a_doubted_line_leaves_the_other_rules_alone():
    relayed = decide(req(64_000), {}, fleet(), LinkView(SLOW, doubt=DOUBT), QUIET, CONFIG)
    assert relayed.pipeline == Pipeline.P_RLD_MD
    assert relayed.rule.code == "transfer_exceeds_budget"
    anomalous = req(64_000, output=100)
    d = decide(anomalous, {}, fleet(), LinkView(SLOW, doubt=DOUBT), QUIET, CONFIG)
    assert d.pipeline == Pipeline.P_RLD


def test_a_relay_whose_queue_outlasts_the_transfer_is_not_chosen():
    """The relay hides what MD's first token waits for after the prefill (one RTT and
    the serialization the prefill does not cover), not the prefill: here 0.4 s of
    prefill and 2.4 s of serialization, so 2.03 s. With 4 requests on the relay at 0.6 s
    each, its queue (2.4 s) outlasts that, so the request stays on P-MD; at 0.05 s each
    (0.2 s) relaying is sooner."""
    n, hits = 64_000, {"p0": 60_000, "md0": 4_000}
    transfer = wan_transfer_seconds(60_000, KVB, SLOW)
    busy = fleet(rld=("rld0", 4, 8))
    stays = decide(req(n), hits, busy, LinkView(SLOW, relay_slot_s=0.6), QUIET, CONFIG)
    assert isinstance(stays, Decision) and stays.pipeline == Pipeline.P_MD
    assert stays.estimate.md_first_token_s == pytest.approx(transfer)  # the line paces it
    assert stays.estimate.md_first_token_s > CONFIG.ttft_budget_s
    assert stays.estimate.after_prefill_s == pytest.approx(transfer - 0.4)
    assert stays.estimate.relay_queue_s == pytest.approx(2.4)
    assert "relay's queue" in stays.reason
    assert stays.rule.code == "relay_not_sooner"
    relays = decide(req(n), hits, busy, LinkView(SLOW, relay_slot_s=0.05), QUIET, CONFIG)
    assert isinstance(relays, Decision) and relays.pipeline == Pipeline.P_RLD_MD
    assert relays.instances.relay == "rld0" and relays.estimate.relay_active == 4
    # An idle relay has no queue, whatever a request ahead would cost.
    idle = decide(req(n), hits, fleet(), LinkView(SLOW, relay_slot_s=5.0), QUIET, CONFIG)
    assert isinstance(idle, Decision) and idle.pipeline == Pipeline.P_RLD_MD


IDLE = replace(CONFIG, idle_relay_min_transfer_s=0.1)


#: 4,000 tokens of MD miss on the slow line (0.16 s of serialization), 500 of P's (0.05 s
#: of prefill): MD's first token comes 0.03 + 0.11 s after the prefill.
HIDDEN = {"p0": 3500}


def test_an_idle_relay_hides_a_transfer_that_fits_the_budget():
    """0.05 s of prefill and a 0.19 s transfer fit the 2 s budget; an idle relay takes
    the request all the same: its first token does not wait for the transfer."""
    decision = run(req(4000), HIDDEN, config=IDLE)
    assert decision.estimate.transfer_s == pytest.approx(0.03 + 4000 * KVB * 8 / 10e9)
    assert decision.estimate.after_prefill_s == pytest.approx(0.03 + 0.16 - 0.05)
    assert decision.estimate.md_first_token_s < IDLE.ttft_budget_s
    assert decision.pipeline == Pipeline.P_RLD_MD and "idle relay" in decision.reason
    assert decision.rule.code == "idle_relay"


def test_a_relay_holding_a_request_is_not_idle():
    busy = fleet(rld=("rld0", 1, 8))
    decision = run(req(4000), HIDDEN, instances=busy, config=IDLE)
    assert decision.pipeline == Pipeline.P_MD
    assert decision.rule.code == "fits_ttft_budget"


def test_an_idle_relay_leaves_a_short_transfer_on_p_md():
    """1,000 tokens of miss: 0.03 + 0.04 s, under the 0.1 s worth hiding."""
    decision = run(req(4000), {"p0": 3000, "md0": 3000}, config=IDLE)
    assert decision.estimate.transfer_s < 0.1
    assert decision.pipeline == Pipeline.P_MD


def test_the_idle_relay_rule_is_the_routers_default():
    assert PolicyConfig.default_of("idle_relay_min_transfer_s") == 0.05
    default = PolicyConfig(kv_bytes_per_token=KVB, ttft_budget_s=2.0, prefill_tokens_per_s=10_000)
    assert run(req(4000), HIDDEN, config=default).pipeline == Pipeline.P_RLD_MD


#: Under adaptive: the exact KV, int8 at about half, int4 at about a quarter.
CODECS = (("none", KVB), ("int8", KVB // 2), ("int4", KVB // 4))
ADAPTIVE = replace(CONFIG, adaptive_codecs=CODECS)


@pytest.mark.parametrize(
    ("gbps", "codec"),
    [(10.0, "none"), (3.0, "int8"), (1.5, "int4"), (0.5, "int4")],
)
def test_adaptive_codes_p_md_with_the_least_lossy_codec_whose_transfer_fits(gbps, codec):
    """20,000 tokens of MD miss, 0.2 s of prefill, a 2 s budget, every relay saturated (P-MD
    serves whatever the line does): at 10 Gbit/s the exact KV (0.8 s) fits; at 3, only
    int8's half (1.33 s) does; at 1.5, only int4's quarter (1.33 s), never int4 where int8
    fits; at 0.5 nothing does and the smallest goes."""
    link = LinkState(declared_gbps=gbps, rtt_ms=30)
    full = fleet(rld=("rld0", 8, 8))
    d = run(req(22_000), {"p0": 20_000, "md0": 2_000}, link=link, instances=full, config=ADAPTIVE)
    assert isinstance(d, Decision) and d.estimate.kv_codec == codec
    assert d.pipeline == Pipeline.P_MD
    bpt = dict(CODECS)[codec]
    assert d.estimate.kv_bytes_per_token == bpt
    assert d.estimate.transfer_s == pytest.approx(wan_transfer_seconds(20_000, bpt, link))
    assert f"KV coded {codec}" in d.reason
    assert (d.estimate.md_first_token_s <= ADAPTIVE.ttft_budget_s) == (gbps > 1.0)


@pytest.mark.parametrize("gbps", [3.0, 1.5, 0.5])
def test_adaptive_relays_the_exact_kv_where_a_relay_serves_first(gbps):
    """The same requests with a relay free: the exact KV misses the budget, so the relay
    serves the first token as it would with no codec, and MD's KV crosses exact (coding
    it would cost precision and win no first token)."""
    link = LinkState(declared_gbps=gbps, rtt_ms=30)
    d = run(req(22_000), {"p0": 20_000, "md0": 2_000}, link=link, config=ADAPTIVE)
    assert d.pipeline == Pipeline.P_RLD_MD
    assert d.estimate.kv_codec == "none" and d.estimate.kv_bytes_per_token == KVB
    assert "KV coded none: the relay serves first" in d.reason
    plain = run(req(22_000), {"p0": 20_000, "md0": 2_000}, link=link)
    assert plain.pipeline == d.pipeline and plain.instances == d.instances


@pytest.mark.parametrize(
    ("gbps", "drain_s", "codec", "fits"),
    [(3.0, 1.9, "none", None), (3.0, 2.1, "int4", True), (1.0, 2.1, "int4", False)],
)
def test_adaptive_codes_a_relayed_kv_only_on_a_line_congested_past_the_budget(
    gbps, drain_s, codec, fits
):
    """A relay serves the first token (the exact KV misses the 2 s budget); MD's KV still
    crosses, and everything committed later queues behind it. While the line's backlog
    drains within the budget the KV crosses exact; past it, coded as P-MD's would be:
    the least lossy that reaches MD within the budget behind the backlog (at 3 Gbit/s
    int8's 0.5 GB waits behind as much: 2.7 s; int4 1.4 s), the smallest where none
    does (1 Gbit/s)."""
    backlog = int(drain_s * gbps * 1e9 / 8)
    link = LinkState(declared_gbps=gbps, rtt_ms=30, backlog_bytes=backlog, backlog_transfers=1)
    d = run(req(22_000), {"p0": 20_000, "md0": 2_000}, link=link, config=ADAPTIVE)
    assert d.pipeline == Pipeline.P_RLD_MD
    assert d.estimate.kv_codec == codec
    assert d.estimate.kv_bytes_per_token == dict(CODECS)[codec]
    assert ("to drain" in d.reason) == (codec != "none")
    if fits is not None:
        assert (d.estimate.md_first_token_s <= ADAPTIVE.ttft_budget_s) == fits


#: Adaptive where MD may compute misses of up to 30,000 tokens itself, at 20,000 tokens/s.
RECOMPUTE = replace(ADAPTIVE, md_recompute_max_tokens=30_000, md_prefill_tokens_per_s=20_000)


@pytest.mark.parametrize(("gbps", "computed"), [(10.0, False), (3.0, True), (0.5, True)])
def test_adaptive_has_md_compute_a_miss_the_exact_kv_cannot_bring_in_time(gbps, computed):
    """The 20,000-token miss of the test above, every relay saturated: where the exact KV
    fits (10 Gbit/s, 0.8 s) it crosses; where it does not, MD computes the miss itself
    (1 s at 20,000 tokens/s after one RTT, P computing nothing: 1.03 s), before int8
    (which fits at 3 Gbit/s, but loses precision) and where no codec fits (0.5 Gbit/s).
    Nothing crosses but the first token."""
    link = LinkState(declared_gbps=gbps, rtt_ms=30)
    full = fleet(rld=("rld0", 8, 8))
    d = run(req(22_000), {"p0": 20_000, "md0": 2_000}, link=link, instances=full, config=RECOMPUTE)
    assert d.pipeline == Pipeline.P_MD and d.estimate.md_computes_miss == computed
    if computed:
        assert d.estimate.kv_codec == "none" and d.estimate.kv_bytes_per_token == 0
        assert d.estimate.md_compute_s == pytest.approx(1.0)
        assert d.estimate.md_first_token_s == pytest.approx(0.03 + 1.0)
        assert "KV computed at MD: it fits the 2.00s budget" in d.reason
    else:
        assert d.estimate.kv_bytes_per_token == KVB and d.estimate.md_compute_s == 0.0


def test_md_computes_no_miss_over_its_cap():
    """A cap of 10,000 tokens leaves the 20,000-token miss to the codecs: int8 at 3 Gbit/s."""
    capped = replace(RECOMPUTE, md_recompute_max_tokens=10_000)
    link = LinkState(declared_gbps=3.0, rtt_ms=30)
    full = fleet(rld=("rld0", 8, 8))
    d = run(req(22_000), {"p0": 20_000, "md0": 2_000}, link=link, instances=full, config=capped)
    assert not d.estimate.md_computes_miss and d.estimate.kv_codec == "int8"


@pytest.mark.parametrize(("md_rate", "computed"), [(4_000, False), (8_000, True)])
def test_where_nothing_fits_the_soonest_way_goes(md_rate, computed):
    """At 0.5 Gbit/s int4 brings the miss in 4.03 s; MD computing it at 4,000 tokens/s
    takes 5.03 s (int4 goes), at 8,000 tokens/s 2.53 s (MD computes it)."""
    config = replace(RECOMPUTE, md_prefill_tokens_per_s=md_rate)
    link = LinkState(declared_gbps=0.5, rtt_ms=30)
    full = fleet(rld=("rld0", 8, 8))
    d = run(req(22_000), {"p0": 20_000, "md0": 2_000}, link=link, instances=full, config=config)
    assert d.estimate.md_computes_miss == computed
    assert d.estimate.kv_codec == ("none" if computed else "int4")
    assert "nothing fits the 2.00s budget, the soonest" in d.reason
    assert d.estimate.md_first_token_s == pytest.approx(2.53 if computed else 4.03, abs=0.01)


def test_md_computes_a_relayed_miss_rather_than_coding_it_on_a_congested_line():
    """A relay serves first and the line's backlog takes 2.1 s to drain (the congested
    case of the test above, which codes the KV int4): MD computing the miss puts nothing
    on the line and loses nothing."""
    backlog = int(2.1 * 3.0e9 / 8)
    link = LinkState(declared_gbps=3.0, rtt_ms=30, backlog_bytes=backlog, backlog_transfers=1)
    d = run(req(22_000), {"p0": 20_000, "md0": 2_000}, link=link, config=RECOMPUTE)
    assert d.pipeline == Pipeline.P_RLD_MD and d.estimate.md_computes_miss
    assert "KV computed at MD" in d.reason and "to drain" in d.reason


@pytest.mark.parametrize(("queued", "codec"), [(10_000, "none"), (30_000, "int8")])
def test_md_computing_waits_behind_what_md_is_already_computing(queued, codec):
    """Every relay saturated, 3 Gbit/s: the exact KV misses the budget (2.7 s). MD
    computes earlier requests' 10,000 tokens first, then this miss: 1.53 s, in the
    budget; behind 30,000 it would take 2.53 s, so int8 (1.36 s) goes instead."""
    view = LinkView(LinkState(declared_gbps=3.0, rtt_ms=30),
                    md_computing_tokens={"md0": queued, "md1": 90_000})  # fmt: skip
    full = fleet(rld=("rld0", 8, 8))
    d = decide(req(22_000), {"p0": 20_000, "md0": 2_000}, full, view, QUIET, RECOMPUTE)
    assert d.pipeline == Pipeline.P_MD and d.estimate.kv_codec == codec
    assert d.estimate.md_computes_miss == (codec == "none")
    if codec == "none":
        assert d.estimate.md_compute_s == pytest.approx(1.5)


@pytest.mark.parametrize(("miss", "computed"), [(4096, True), (4097, False)])
def test_under_adaptive_md_computes_a_miss_of_up_to_4096_tokens_by_default(miss, computed):
    """The default cap: at 0.1 Gbit/s no codec brings a 4,096-token miss in within the
    2 s budget (int4's quarter of 205 MB takes 4.1 s), MD computing it at P's 10,000
    tokens/s does (0.41 s); one token more goes to the codecs (int4: the soonest)."""
    assert PolicyConfig.default_of("md_recompute_max_tokens") == 4096
    assert ADAPTIVE.md_recompute_max_tokens == MD_RECOMPUTE_MAX_TOKENS
    link = LinkState(declared_gbps=0.1, rtt_ms=30)
    full = fleet(rld=("rld0", 8, 8))
    hits = {"p0": miss + 1000, "md0": 1000}
    d = run(req(miss + 1000), hits, link=link, instances=full, config=ADAPTIVE)
    assert d.estimate.md_computes_miss == computed
    assert d.estimate.kv_codec == ("none" if computed else "int4")
    if computed:
        assert d.estimate.md_compute_s == pytest.approx(miss / 10_000)


def test_a_negative_md_recompute_cap_is_refused():
    with pytest.raises(ValueError, match="md_recompute_max_tokens"):
        replace(ADAPTIVE, md_recompute_max_tokens=-1)


def test_a_fixed_codec_names_none_in_the_estimate():
    d = run(req(22_000), {"p0": 20_000, "md0": 2_000})
    assert d.estimate.kv_codec is None and "KV coded" not in d.reason


#: A turn of 2,000 tokens that P and MD both lack, beside 62,000 both hold: P prefills it
#: in 0.2 s, its exact KV (100 MB) crosses 1 Gbit/s in 0.8 s.
TURN = (req(64_000), {"p0": 62_000, "md0": 62_000})


def test_md_computes_a_small_miss_where_that_is_sooner_than_its_crossing():
    """Under a fixed codec too: MD prefilling the 2,000 tokens itself (0.2 s after one RTT,
    P computing nothing) beats the exact KV (one RTT + 0.8 s), and loses nothing."""
    d = run(*TURN, link=LinkState(declared_gbps=1.0, rtt_ms=30))
    assert d.pipeline == Pipeline.P_MD and d.estimate.md_computes_miss
    assert d.estimate.md_first_token_s == pytest.approx(0.03 + 0.2)
    assert d.estimate.kv_bytes_per_token == 0 and d.estimate.kv_codec is None
    assert "KV computed at MD: 0.23s, sooner than its crossing" in d.reason
    assert d.rule.code == "fits_ttft_budget"


def test_the_kv_crosses_where_its_line_keeps_pace_with_the_prefill():
    """At 10 Gbit/s the 100 MB cross in 0.08 s, within P's 0.2 s prefill: the exact KV
    comes as soon as MD could compute it, and P-MD ships it."""
    d = run(*TURN, link=SLOW)
    assert d.pipeline == Pipeline.P_MD and not d.estimate.md_computes_miss
    assert d.estimate.kv_bytes_per_token is None and "computed" not in d.reason


@pytest.mark.parametrize("cap", [0, 1_999])
def test_md_computes_no_miss_over_the_cap_under_a_fixed_codec(cap):
    d = run(*TURN, link=LinkState(declared_gbps=1.0, rtt_ms=30),
            config=replace(CONFIG, md_recompute_max_tokens=cap))  # fmt: skip
    assert d.pipeline == Pipeline.P_MD and not d.estimate.md_computes_miss


def test_an_idle_relay_still_serves_a_new_conversation_whose_kv_lags():
    """The pipeline is chosen on the exact KV's estimate: a new 2,000-token conversation
    whose KV would reach MD 0.63 s after the prefill goes to an idle relay (its first
    token after P's 0.2 s), not to MD computing it (one RTT later)."""
    config = replace(CONFIG, idle_relay_min_transfer_s=0.05)
    d = run(req(2_000), {}, link=LinkState(declared_gbps=1.0, rtt_ms=30), config=config)
    assert d.pipeline == Pipeline.P_RLD_MD and not d.estimate.md_computes_miss
