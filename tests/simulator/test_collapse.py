"""The collapse scenario: relays overload when MD keeps no history (DRC off) or when
low-hit traffic ends at the relays, and stay clear with the DRC on."""

from __future__ import annotations

import pytest

from pdd.simulator.analysis import compare
from pdd.simulator.scenario import load_scenario

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report() -> dict:
    scenario, base = load_scenario("collapse")
    return compare(scenario, base, goodput=False)


def after_warmup(report: dict, system: str) -> list[dict]:
    run = report["_runs"][system]
    return [s for s in report["timeseries"][system] if run.warmup_s <= s["t"] <= run.score_until_s]


def test_with_the_drc_on_the_relays_never_saturate(report: dict) -> None:
    on = report["systems"]["drc-on"]
    assert on["relay_overload_share"] == 0.0
    assert max(s["relay_utilization"] for s in after_warmup(report, "drc-on")) < 1.0
    assert on["md_hit_ratio"] > 0.7 and on["rld_token_share"] < 0.05
    assert on["slo_attainment"] > 0.9


def test_with_the_drc_off_the_relays_overload_and_latency_runs_away(report: dict) -> None:
    on, off = report["systems"]["drc-on"], report["systems"]["drc-off"]
    assert off["md_hit_ratio"] == 0.0  # every turn ships its whole prompt
    assert off["wan_gbytes"] > 2 * on["wan_gbytes"]
    # Full in a share of the samples (none with the DRC on), near full in most (below).
    assert off["relay_overload_share"] > 0.1
    assert off["rld_token_share"] > 0.3  # the relays decode a third of every token
    assert off["relay_fallbacks"] > 0  # requests that needed a relay and found none
    assert off["ttft_p99"] > 10 * on["ttft_p99"]
    # Overload lasts: through the second half the relays are over 85% busy in at least
    # half the samples (a snapshot may catch slots just freed, so "full at every sample"
    # is too strict), and requests keep finding no relay.
    samples = after_warmup(report, "drc-off")
    late = samples[len(samples) // 2 :]
    busy = sorted(s["relay_utilization"] for s in late)
    assert busy[len(busy) // 2] > 0.85
    assert late[-1]["relay_fallbacks"] > late[0]["relay_fallbacks"]


def test_low_hit_traffic_ending_at_the_relays_overloads_them(report: dict) -> None:
    on, low = report["systems"]["drc-on"], report["systems"]["low-hit-to-relay"]
    assert low["relay_overload_share"] > 0.3
    assert low["rld_token_share"] > 5 * on["rld_token_share"]
    assert low["pipelines"].get("P-RLD", 0) > 2 * on["pipelines"].get("P-RLD", 0)
