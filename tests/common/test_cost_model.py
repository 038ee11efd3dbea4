import math
import random

import pytest

from pdd.common.cost_model import (
    MISS_SHAPE,
    LinkState,
    WorkloadProfile,
    kv_bytes_per_token,
    kv_bytes_per_token_from_hf_config,
    pmd_first_token_seconds,
    queued_ahead_bytes,
    regularized_incomplete_beta,
    size_wan_link,
    wan_transfer_seconds,
)

pytestmark = pytest.mark.unit

LLAMA_8B = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}


def test_kv_bytes_per_token_counts_k_and_v_per_layer_and_head():
    assert kv_bytes_per_token(32, 8, 128, 2) == 2 * 32 * 8 * 128 * 2 == 131072


def test_kv_bytes_per_token_rejects_non_positive():
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_bytes_per_token(32, 0, 128, 2)


def test_hf_config_derives_head_dim_and_dtype():
    assert kv_bytes_per_token_from_hf_config(LLAMA_8B) == 131072


def test_hf_config_explicit_head_dim_and_dtype_override():
    cfg = {**LLAMA_8B, "head_dim": 64}
    assert kv_bytes_per_token_from_hf_config(cfg, dtype_bytes=1) == 2 * 32 * 8 * 64


def test_hf_config_without_kv_heads_uses_attention_heads():
    cfg = {k: v for k, v in LLAMA_8B.items() if k != "num_key_value_heads"}
    assert kv_bytes_per_token_from_hf_config(cfg) == 4 * 131072


def test_hf_config_nested_text_config():
    assert kv_bytes_per_token_from_hf_config({"text_config": LLAMA_8B}) == 131072


@pytest.mark.parametrize("missing", ["num_hidden_layers", "num_attention_heads", "hidden_size"])
def test_hf_config_missing_key_is_named(missing):
    cfg = {k: v for k, v in LLAMA_8B.items() if k != missing}
    with pytest.raises(ValueError, match=missing):
        kv_bytes_per_token_from_hf_config(cfg)


def test_hf_config_without_dtype_asks_for_dtype_bytes():
    cfg = {k: v for k, v in LLAMA_8B.items() if k != "torch_dtype"}
    with pytest.raises(ValueError, match="dtype_bytes"):
        kv_bytes_per_token_from_hf_config(cfg)
    assert kv_bytes_per_token_from_hf_config(cfg, dtype_bytes=2) == 131072


def test_hf_config_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype"):
        kv_bytes_per_token_from_hf_config({**LLAMA_8B, "torch_dtype": "float7"})


def test_effective_gbps_prefers_positive_measurement():
    assert LinkState(10, 30).effective_gbps == 10
    assert LinkState(10, 30, measured_goodput_gbps=4).effective_gbps == 4
    assert LinkState(10, 30, measured_goodput_gbps=0).effective_gbps == 10


def test_link_state_validates():
    with pytest.raises(ValueError, match="declared_gbps"):
        LinkState(0, 30)
    with pytest.raises(ValueError, match="rtt_ms"):
        LinkState(10, -1)


def test_wan_transfer_seconds_is_serialization_plus_rtt():
    link = LinkState(declared_gbps=10, rtt_ms=40)
    # 10_000 tokens * 100 KB = 1 GB = 8 Gbit over 10 Gbps = 0.8 s, plus 0.04 s.
    assert wan_transfer_seconds(10_000, 100_000, link) == pytest.approx(0.84)
    assert wan_transfer_seconds(0, 100_000, link) == pytest.approx(0.04)


def test_wan_transfer_uses_measured_goodput():
    link = LinkState(declared_gbps=10, rtt_ms=0, measured_goodput_gbps=5)
    assert wan_transfer_seconds(10_000, 100_000, link) == pytest.approx(1.6)


def test_a_new_transfer_queues_behind_the_backlog_at_most_its_own_size_per_transfer():
    link = LinkState(declared_gbps=10, rtt_ms=30)
    # Three transfers ahead, each larger than the new one: each delays it by its own size
    # (a fair share of the line), so serialization takes 4x as long; the RTT does not change.
    busy = LinkState(10, 30, backlog_bytes=3 * 10**9, backlog_transfers=3)
    assert queued_ahead_bytes(busy, 10_000_000) == 30_000_000
    alone, shared = (wan_transfer_seconds(10_000, 1000, x) for x in (link, busy))
    assert shared - 0.03 == pytest.approx(4 * (alone - 0.03))
    # Three small ones ahead: the new one waits for what they still hold, no more.
    small = LinkState(10, 30, backlog_bytes=3_000, backlog_transfers=3)
    assert queued_ahead_bytes(small, 10_000_000) == 3_000
    # Nothing to send, nothing to wait for but the round trip.
    assert wan_transfer_seconds(0, 1000, busy) == pytest.approx(0.03)
    with pytest.raises(ValueError, match="backlog"):
        LinkState(10, 30, backlog_bytes=-1)


def test_a_request_waits_for_all_of_the_kv_its_hit_counts_on():
    """A small miss alone shares the line fairly with the transfers ahead; where the hit
    it counts on is one of them, still crossing, it waits for that one whole."""
    busy = LinkState(0.08, 30, backlog_bytes=10 * 10**6, backlog_transfers=1)  # 1 s of KV
    fair = wan_transfer_seconds(10, 1000, busy)
    assert fair == pytest.approx(0.03 + 2 * 10_000 * 8 / 0.08e9)
    awaited = wan_transfer_seconds(10, 1000, busy, awaited_bytes=10 * 10**6)
    assert awaited == pytest.approx(0.03 + (10_000 + 10 * 10**6) * 8 / 0.08e9)
    # Awaiting less than the fair share costs nothing more.
    assert wan_transfer_seconds(10, 1000, busy, awaited_bytes=5_000) == pytest.approx(fair)


def test_wan_transfer_rejects_negative_counts():
    with pytest.raises(ValueError, match=">= 0"):
        wan_transfer_seconds(-1, 10, LinkState(10, 1))
    with pytest.raises(ValueError, match=">= 0"):
        wan_transfer_seconds(1, 10, LinkState(10, 1), awaited_bytes=-1)


@pytest.mark.parametrize(("a", "b"), [(MISS_SHAPE, MISS_SHAPE * 9), (2.0, 5.0), (0.5, 0.5)])
def test_incomplete_beta_matches_monte_carlo(a, b):
    rng = random.Random(7)
    draws = [rng.betavariate(a, b) for _ in range(40_000)]
    for x in (0.01, 0.05, 0.3, 0.7):
        empirical = sum(d <= x for d in draws) / len(draws)
        assert regularized_incomplete_beta(x, a, b) == pytest.approx(empirical, abs=0.01)


def test_incomplete_beta_closed_form():
    # I_x(1, 1) = x (uniform) and I_x(2, 1) = x^2.
    assert regularized_incomplete_beta(0.3, 1, 1) == pytest.approx(0.3)
    assert regularized_incomplete_beta(0.3, 2, 1) == pytest.approx(0.09)


def test_miss_model_matches_technique_skew():
    """At a 90% mean hit rate, 70-80% of requests hit above 95%."""
    b = MISS_SHAPE * 0.9 / 0.1
    assert 0.70 <= regularized_incomplete_beta(0.05, MISS_SHAPE, b) <= 0.80


WORKLOAD = WorkloadProfile(
    request_rate=10, mean_input_tokens=128_000, mean_output_tokens=1_000, mean_md_hit_rate=0.9
)
KVB = 50_000  # ~50 KB per token, the technique's typical figure


def test_required_gbps_formula():
    link = LinkState(declared_gbps=100, rtt_ms=30)
    sizing = size_wan_link(WORKLOAD, KVB, link, ttft_budget_s=2.0, burst_factor=2.0)
    expected = 10 * 128_000 * 0.1 * KVB * 8 / 1e9 * 2.0
    assert sizing.required_gbps == pytest.approx(expected)
    assert sizing.headroom == pytest.approx(100 / expected)
    assert sizing.sufficient is (expected <= 100)
    assert sizing.declared_gbps == 100


def test_insufficient_when_measured_goodput_is_low():
    link = LinkState(declared_gbps=200, rtt_ms=30, measured_goodput_gbps=5)
    sizing = size_wan_link(WORKLOAD, KVB, link, ttft_budget_s=2.0)
    assert sizing.headroom > 1
    assert not sizing.sufficient


def test_relay_share_is_tail_probability_of_the_miss_model():
    link = LinkState(declared_gbps=25, rtt_ms=30)
    budget = 2.0
    sizing = size_wan_link(WORKLOAD, KVB, link, ttft_budget_s=budget)
    full = 128_000 * KVB * 8 / 25e9
    threshold = (budget - 0.03) / full
    b = MISS_SHAPE * 0.9 / 0.1
    assert sizing.expected_relay_share == pytest.approx(
        1 - regularized_incomplete_beta(threshold, MISS_SHAPE, b)
    )
    assert 0 < sizing.expected_relay_share < 0.25


def test_relay_share_shrinks_as_link_grows_and_hit_rate_rises():
    shares = [
        size_wan_link(WORKLOAD, KVB, LinkState(g, 30), 2.0).expected_relay_share
        for g in (5, 10, 25, 100)
    ]
    assert shares == sorted(shares, reverse=True)
    assert shares[0] > shares[-1]
    hot = WorkloadProfile(10, 128_000, 1_000, 0.98)
    assert (
        size_wan_link(hot, KVB, LinkState(10, 30), 2.0).expected_relay_share
        < size_wan_link(WORKLOAD, KVB, LinkState(10, 30), 2.0).expected_relay_share
    )


def test_no_relays_needed_when_even_a_full_miss_fits():
    link = LinkState(declared_gbps=1000, rtt_ms=10)
    sizing = size_wan_link(WORKLOAD, KVB, link, ttft_budget_s=5.0)
    assert sizing.expected_relay_share == 0.0
    assert sizing.relay_replicas_min == sizing.relay_replicas_max == 1


def test_rtt_over_budget_relays_everything():
    sizing = size_wan_link(WORKLOAD, KVB, LinkState(100, rtt_ms=3000), ttft_budget_s=2.0)
    assert sizing.expected_relay_share == 1.0


def test_full_hit_and_full_miss_edges():
    link = LinkState(10, 30)
    full_hit = WorkloadProfile(10, 128_000, 1_000, 1.0)
    sizing = size_wan_link(full_hit, KVB, link, 2.0)
    assert sizing.required_gbps == 0 and sizing.headroom == math.inf
    assert sizing.expected_relay_share == 0.0
    full_miss = WorkloadProfile(10, 128_000, 1_000, 0.0)
    assert size_wan_link(full_miss, KVB, link, 2.0).expected_relay_share == 1.0


def test_relay_replicas_follow_capacity_and_burst():
    link = LinkState(declared_gbps=10, rtt_ms=30)
    sizing = size_wan_link(WORKLOAD, KVB, link, 2.0, burst_factor=3.0, relay_capacity_rps=0.1)
    relayed = sizing.expected_relay_share * WORKLOAD.request_rate
    assert sizing.relay_replicas_min == max(1, math.ceil(relayed / 0.1))
    assert sizing.relay_replicas_max == max(sizing.relay_replicas_min, math.ceil(relayed * 3 / 0.1))
    assert sizing.relay_replicas_max > sizing.relay_replicas_min > 1


def test_relay_replicas_default_grow_with_rate():
    link = LinkState(declared_gbps=10, rtt_ms=30)
    small = size_wan_link(WORKLOAD, KVB, link, 2.0)
    big = size_wan_link(WorkloadProfile(1000, 128_000, 1_000, 0.9), KVB, link, 2.0)
    assert big.relay_replicas_min > small.relay_replicas_min


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ttft_budget_s": 0}, "ttft_budget_s"),
        ({"ttft_budget_s": 1, "burst_factor": 0.5}, "burst_factor"),
        ({"ttft_budget_s": 1, "relay_capacity_rps": 0}, "relay_capacity_rps"),
    ],
)
def test_size_wan_link_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        size_wan_link(WORKLOAD, KVB, LinkState(10, 30), **kwargs)


def test_workload_validates_hit_rate():
    with pytest.raises(ValueError, match="mean_md_hit_rate"):
        WorkloadProfile(1, 1, 1, 1.5)


def test_pmd_first_token_overlaps_the_prefill_and_the_transfer():
    """One RTT, the longer of prefill and serialization (P streams KV as it prefills),
    then MD's first step: the line paces a long transfer, the prefill a short one."""
    link = LinkState(declared_gbps=1, rtt_ms=40)
    transfer = wan_transfer_seconds(10_000, 10_000, link)  # 0.8 s on the line + the RTT
    assert pmd_first_token_seconds(0.3, transfer, link.rtt_s) == pytest.approx(0.84)
    assert pmd_first_token_seconds(1.5, transfer, link.rtt_s, 0.02) == pytest.approx(1.56)
    assert pmd_first_token_seconds(0.0, link.rtt_s, link.rtt_s) == pytest.approx(0.04)
    with pytest.raises(ValueError):
        pmd_first_token_seconds(-0.1, transfer, link.rtt_s)
