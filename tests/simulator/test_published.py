"""The published setup, end to end through ``pdd simulate published --json``: the figures
the technique reports, within the bands the issue sets (a slow suite: goodput searches)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdd.cli import main as pdd_main

#: The goodput searches take about five minutes of two cores, ten beside the other tests,
#: more on a loaded machine: the limit is there to catch a hang, not a slow machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

KEYS = ("ttft_p50", "ttft_p99", "goodput_rps", "cost", "bcr", "rld_token_share")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out: Path = tmp_path_factory.mktemp("published") / "report.json"
    assert pdd_main(["simulate", "published", "--json", str(out), "--quiet"]) == 0
    return json.loads(out.read_text())


def test_the_report_has_every_figure_others_rely_on(report: dict) -> None:
    assert {"baseline", "naive", "pdd"} <= set(report["systems"])
    for figures in report["systems"].values():
        assert all(isinstance(figures[k], int | float) for k in KEYS)
    assert {"bcr_gain", "cost_saving"} <= set(report)


def test_pdd_costs_3_5_to_7_1_percent_less_across_the_premium_range(report: dict) -> None:
    savings = [row["saving"] for row in report["cost_by_premium"]]
    assert [row["premium"] for row in report["cost_by_premium"]] == [0.2, 0.3]
    assert savings[0] == pytest.approx(0.0714, abs=5e-4)
    assert savings[1] == pytest.approx(0.035, abs=1e-9)
    assert 0.035 <= report["cost_saving"] <= 0.0715


def test_benefit_cost_ratio_improves_by_20_to_45_percent(report: dict) -> None:
    assert 0.20 <= report["bcr_gain"] <= 0.45


def test_pdd_tail_ttft_is_under_half_of_naive_cross_datacenter_pd(report: dict) -> None:
    assert report["systems"]["pdd"]["ttft_p99"] < 0.5 * report["systems"]["naive"]["ttft_p99"]


def test_relay_decode_produces_under_10_percent_of_output_tokens(report: dict) -> None:
    assert 0 < report["systems"]["pdd"]["rld_token_share"] < 0.10
