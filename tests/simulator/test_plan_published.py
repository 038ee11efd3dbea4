"""``pdd plan`` on the published setup at its latency load (24.5 requests/s, which the
published 39 P + 4 RLD + 32 MD serves within the SLO): the planner finds a PDD deployment
that meets the same SLO for no more than the published one costs, and same-datacenter PD
sized for that SLO costs more (a slow suite: two searches, docs/planner.md)."""

from __future__ import annotations

import json

import pytest

from pdd.cli import main as pdd_main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

PUBLISHED_PDD_COST = 39 * 2.0 + 4 * 2.0 + 32 * 2.5 + 0.64


def test_the_plan_meets_the_slo_at_no_more_than_the_published_cost(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--trace", "published", "--rate", "24.5", "--slo-ttft-p90", "10",
            "--slo-itl-p90", "0.08", "--json"]  # fmt: skip
    assert pdd_main(argv) == 0
    plans = {p["kind"]: p for p in json.loads(capsys.readouterr().out)["plans"]}
    pdd, same_dc = plans["pdd"], plans["same-dc"]
    assert pdd["feasible"] and pdd["ttft_p90_s"] <= 10 and pdd["itl_p90_s"] <= 0.08
    assert pdd["cost_per_hour"] <= PUBLISHED_PDD_COST
    assert same_dc["cost_per_hour"] > pdd["cost_per_hour"]
