"""A request's path through each system, on small hand-made traces where every byte and
token can be counted."""

from __future__ import annotations

import math

import pytest

from pdd.local.traces.base import Chain, Trace, TraceRequest
from pdd.simulator.lifecycle import handoff_bytes
from pdd.simulator.runner import simulate
from pdd.simulator.scenario import Scenario, load_scenario

pytestmark = pytest.mark.unit

BLOCK = 512
KVB = 51200  # the published model's KV bytes per token


def small(wan_gbps: float = 100.0, handoff: str = "auto", **run) -> Scenario:
    """The published scenario shrunk to two P, one RLD, two MD (or D)."""
    s, _ = load_scenario("published")
    systems = {}
    for name, spec in s.systems.items():
        update = {
            pool: getattr(spec, pool).model_copy(update={"instances": 1 if pool == "relay" else 2})
            for pool in spec.pools()
        }
        systems[name] = spec.model_copy(update=update)
    return s.model_copy(
        update={
            "systems": systems,
            "wan": s.wan.model_copy(update={"gbps": wan_gbps, "jitter_ms": 0.0}),
            "handoff": s.handoff.model_copy(update={"mode": handoff}),
            "run": s.run.model_copy(update={"warmup_s": 0.0, **run}),
        }
    )


def budget_rules_only(s: Scenario) -> Scenario:
    """The router without its idle-relay rule: P-MD whenever the transfer fits the budget
    (an idle relay would otherwise take every transfer of 0.05 s or more)."""
    return s.model_copy(
        update={"router": s.router.model_copy(update={"idle_relay_min_transfer_s": None})}
    )


def request(key: str, blocks: range, output: int, think_s: float = 0.0) -> TraceRequest:
    ids = tuple(blocks)
    return TraceRequest(key, "t", ids, len(ids) * BLOCK, output, BLOCK, think_s)


def conversation(*turns: TraceRequest, start: float = 0.0, name: str = "c") -> Chain:
    return Chain(name, start, turns)


def trace(*chains: Chain) -> Trace[TraceRequest]:
    return Trace("test", BLOCK, chains)


def two_turns() -> Trace[TraceRequest]:
    """Turn 2 resends turn 1's 40 blocks and adds 2: a 95% hit."""
    return trace(
        conversation(request("c#0", range(40), 50), request("c#1", range(42), 50, think_s=5.0))
    )


def test_naive_ships_every_prompts_full_kv_and_keeps_no_history() -> None:
    run = simulate(small(), "naive", two_turns())
    first, second = run.records
    assert first.wan_bytes == 40 * BLOCK * KVB
    assert second.wan_bytes == 42 * BLOCK * KVB  # no DRC: turn 1 crosses again
    assert second.md_hit_tokens == 0
    assert run.wan_bytes == first.wan_bytes + second.wan_bytes


def test_pdd_ships_only_mds_miss_and_turn_two_hits_the_drc() -> None:
    run = simulate(budget_rules_only(small()), "pdd", two_turns())
    first, second = run.records
    assert (first.pipeline, second.pipeline) == ("P-MD", "P-MD")
    assert second.md_hit_tokens == 40 * BLOCK and second.p_hit_tokens == 40 * BLOCK
    assert second.wan_bytes == 2 * BLOCK * KVB
    assert all(not math.isnan(r.finish) for r in run.records)


def test_the_same_datacenter_baseline_never_touches_the_wan() -> None:
    run = simulate(small(), "baseline", two_turns())
    assert run.wan_bytes == 0 and run.wan_gbps is None
    assert all(r.wan_bytes == 0 and r.pipeline == "P-MD" for r in run.records)


def slow_link_trace(output: int = 400) -> Trace[TraceRequest]:
    # 20 blocks of 50 KB tokens = 524 MB: ~4.2 s on a 1 Gbit/s line, over the 2 s budget.
    return trace(conversation(request("r#0", range(20), output)))


def test_a_slow_transfer_is_relayed_then_handed_over_as_token_ids() -> None:
    run = simulate(small(wan_gbps=1.0), "pdd", slow_link_trace())
    (r,) = run.records
    serialization = 20 * BLOCK * KVB * 8 / 1e9
    assert r.pipeline == "P-RLD-MD"
    assert r.ttft < 1.0 < serialization  # the relay streamed long before MD had the KV
    assert r.handoff in ("one-shot", "catch-up")
    assert 1 < r.rld_tokens < r.output_tokens
    # Only KV for MD's miss and token IDs crossed: never the relay's KV.
    kv = 20 * BLOCK * KVB
    assert kv < r.wan_bytes <= kv + r.rld_tokens * 4 + 8 * (r.rld_tokens // 64 + 2)
    assert r.finish > serialization


@pytest.mark.parametrize("mode", ["one-shot", "catch-up"])
def test_both_handoff_modes_finish_and_catch_up_keeps_the_relay_longer(mode: str) -> None:
    run = simulate(small(wan_gbps=1.0, handoff=mode), "pdd", slow_link_trace(output=2000))
    (r,) = run.records
    assert r.handoff == mode and not math.isnan(r.finish)
    stalls = run.extras["main_stall_s"]
    assert stalls > 0
    if mode == "one-shot":
        # One extend of everything the relay produced: the stream's gap covers it.
        assert r.handoff_gap_s >= stalls
    else:
        # Chunks were recomputed while the relay kept streaming; the final gap is small.
        one_shot = simulate(small(wan_gbps=1.0, handoff="one-shot"), "pdd", slow_link_trace(2000))
        assert r.rld_tokens > one_shot.records[0].rld_tokens
        assert r.handoff_gap_s < one_shot.records[0].handoff_gap_s


def test_anomalous_traffic_ends_on_the_relay_and_never_crosses_the_wan() -> None:
    # The router caps relay-only traffic at 5% of recent requests: 30 small ones first.
    small_ones = [request(f"s#{i}", range(1000 + i, 1001 + i), 5, think_s=0.1) for i in range(30)]
    long_short = request("a#0", range(80), 100, think_s=0.1)  # 40,960 tokens in, 100 out
    run = simulate(small(wan_gbps=1.0), "pdd", trace(conversation(*small_ones, long_short)))
    r = run.records[-1]
    assert r.pipeline == "P-RLD", r.reason
    assert r.wan_bytes == 0
    assert run.wan_bytes == sum(x.wan_bytes for x in run.records[:-1])
    assert r.rld_tokens == r.output_tokens


def test_relay_only_traffic_is_capped_so_it_cannot_absorb_normal_traffic() -> None:
    """Alone, the same request would be 100% of recent traffic: it is relayed to MD."""
    run = simulate(small(wan_gbps=1.0), "pdd", trace(conversation(request("a#0", range(80), 100))))
    (r,) = run.records
    assert r.pipeline == "P-RLD-MD" and "anomalous but P-RLD would be" in r.reason


def test_every_request_of_a_generated_workload_finishes_with_tokens_conserved() -> None:
    s = small(drain_s=3600.0)
    workload = s.workload.model_copy(update={"rate_rps": 0.3, "duration_s": 120})
    for name in ("baseline", "naive", "pdd"):
        run = simulate(s, name, workload.build())
        assert run.records and not any(r.lost for r in run.records), name
        assert all(not math.isnan(r.finish) for r in run.records), name
        assert all(0 <= r.rld_tokens <= r.output_tokens for r in run.records)
        assert all(r.first_token <= r.finish for r in run.records)
        relayed = [r for r in run.records if r.pipeline == "P-RLD-MD"]
        wan_kv = sum((r.input_tokens - r.md_hit_tokens) * KVB for r in run.records)
        if name == "pdd":
            p_rld = [r for r in run.records if r.pipeline == "P-RLD"]
            kv = wan_kv - sum((r.input_tokens - r.md_hit_tokens) * KVB for r in p_rld)
            ids = sum(r.wan_bytes for r in run.records) - kv
            assert 0 <= ids <= sum(handoff_bytes(r.rld_tokens) * 4 for r in relayed)


def test_a_transfer_committed_at_dispatch_queues_the_next_one_behind_it() -> None:
    """Alone, each request's KV crosses within the budget (P-MD). The second, dispatched
    while the first's KV is committed to the line (its P still prefilling, not a byte
    sent yet), queues behind it in the router's link estimator: it is relayed. (MD
    computing misses is off: it would compute the first, which commits nothing.)"""
    one = trace(conversation(request("a#0", range(8), 50)))
    line = budget_rules_only(small(wan_gbps=1.5))
    line = line.model_copy(
        update={"router": line.router.model_copy(update={"md_recompute_max_tokens": 0})}
    )
    alone = simulate(line, "pdd", one)  # 1.3 s estimated, 2 s budget
    assert [r.pipeline for r in alone.records] == ["P-MD"]
    both = trace(
        conversation(request("a#0", range(8), 50), name="a"),
        conversation(request("b#0", range(100, 108), 50), start=0.001, name="b"),
    )
    first, second = simulate(line, "pdd", both).records
    assert (first.pipeline, second.pipeline) == ("P-MD", "P-RLD-MD")


def test_the_router_s_idle_relay_rule_runs_in_the_simulator_too() -> None:
    """The simulator decides through the router's policy with the router's defaults: an
    idle relay takes a transfer that fits the budget (1.3 s of 2 s) but is long enough
    to hide, where the budget rules alone choose P-MD."""
    one = trace(conversation(request("a#0", range(8), 50)))
    (relayed,) = simulate(small(wan_gbps=1.5), "pdd", one).records
    assert relayed.pipeline == "P-RLD-MD" and relayed.rld_tokens > 0


def test_p_streams_kv_while_it_prefills_so_the_slower_of_the_two_sets_ttft() -> None:
    """A new conversation P-MD on a line slower than P's prefill: its KV crosses while P
    computes (from the end of P's first step), so the first token waits for the longer
    of the two, not their sum, yet for no less than the whole transfer and the RTT."""
    one = trace(conversation(request("c#0", range(40), 5)))
    s = small(wan_gbps=1e6)  # the line costs nothing: the prefill (and the RTT) alone
    s = s.model_copy(update={"router": s.router.model_copy(update={"ttft_budget_s": 100.0})})
    prefill_only = simulate(budget_rules_only(s), "pdd", one).records[0]
    slow = s.model_copy(update={"wan": s.wan.model_copy(update={"gbps": 5.0})})
    streamed = simulate(budget_rules_only(slow), "pdd", one).records[0]
    assert prefill_only.pipeline == streamed.pipeline == "P-MD"
    serial_s = 40 * BLOCK * KVB * 8 / 5e9
    assert serial_s > prefill_only.ttft  # the line is the slower of the two
    assert streamed.ttft >= serial_s + slow.wan.rtt_ms / 1000
    assert streamed.ttft < serial_s + 0.5 * prefill_only.ttft  # far from their sum


def test_adaptive_relays_the_exact_kv_where_a_relay_serves_first() -> None:
    """``wan.kv_codec: adaptive``: on a line where turn 1's whole KV (20,480 tokens)
    cannot make the budget exact and the relay has room, the router relays it as it
    would with no codec, and MD's KV crosses exact (coding would win no first token).
    Nothing is coded, so MD keeps turn 1: turn 2's miss is 2 blocks, which MD computes
    on P-MD (sooner than their crossing) and nothing crosses."""
    s = budget_rules_only(small(wan_gbps=3.0))
    s = s.model_copy(
        update={
            "wan": s.wan.model_copy(update={"kv_codec": "adaptive"}),
            "router": s.router.model_copy(update={"ttft_budget_s": 2.0}),
        }
    )
    first, second = simulate(s, "pdd", two_turns()).records
    assert first.pipeline == "P-RLD-MD" and first.kv_codec == "none"
    assert second.pipeline == "P-MD" and second.md_computes_miss and second.wan_bytes == 0
    assert second.md_hit_tokens == 40 * BLOCK  # MD kept turn 1
    fixed = simulate(budget_rules_only(small(wan_gbps=3.0)), "pdd", two_turns()).records[0]
    assert fixed.kv_codec == "" and fixed.wan_bytes == 40 * BLOCK * KVB
    assert (first.pipeline, first.wan_bytes) == (fixed.pipeline, fixed.wan_bytes)


def test_adaptive_has_md_compute_a_miss_no_transfer_brings_in_time() -> None:
    """With MD allowed to compute misses (``md_recompute_max_tokens``) on a line too slow
    for turn 1's whole KV, every relay saturated away (none in the system): MD computes
    turn 1's 20,480 tokens itself and nothing crosses; its cache then holds turn 1, so
    turn 2's miss is 2 blocks, which MD computes too (sooner than their crossing)."""
    s = budget_rules_only(small(wan_gbps=0.5))
    pdd = s.systems["pdd"]
    s = s.model_copy(
        update={
            "systems": {**s.systems, "pdd": pdd.model_copy(update={"relay": None})},
            "wan": s.wan.model_copy(update={"kv_codec": "adaptive"}),
            "router": s.router.model_copy(
                update={"ttft_budget_s": 2.0, "md_recompute_max_tokens": 32_768}
            ),
        }
    )
    first, second = simulate(s, "pdd", two_turns()).records
    assert first.pipeline == "P-MD" and first.md_computes_miss and first.wan_bytes == 0
    assert "KV computed at MD" in first.reason
    assert second.md_computes_miss and second.wan_bytes == 0
    assert second.md_hit_tokens == 40 * BLOCK
    assert first.first_token is not None and first.finish is not None


def test_requests_still_at_p_take_no_md_slot_as_in_the_router() -> None:
    """Six new conversations at once on two MDs of two slots each (issue 59, run 6): the
    router counts a request on its MD as pending while P serves it, so none is refused
    for MD's capacity; MD queues what exceeds its batch when the requests reach it."""
    s = small(wan_gbps=100.0)
    pdd = s.systems["pdd"]
    pdd = pdd.model_copy(update={"main": pdd.main.model_copy(update={"max_batch": 2})})
    s = s.model_copy(update={"systems": {**s.systems, "pdd": pdd}})
    burst = trace(
        *(conversation(request(f"c{i}#0", range(100 * i, 100 * i + 8), 20), name=f"c{i}")
          for i in range(6))
    )  # fmt: skip
    run = simulate(budget_rules_only(s), "pdd", burst)
    assert [r.retries for r in run.records] == [0] * 6
    assert all(r.finish > r.first_token for r in run.records)
