"""``pdd plan``: flags and pools file checked with a reason, and a small plan end to end
(on the published setup's hardware with a light load, two probes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdd.cli import main as pdd_main

pytestmark = pytest.mark.unit

BASE = ["plan", "--trace", "published", "--rate", "2", "--slo-ttft-p90", "10",
        "--slo-itl-p90", "0.08"]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--rate", "-1"], "--rate must be a positive number"),
        (["--slo-ttft-p90", "0"], "SLO targets must be positive"),
        (["--trace", "no/such/trace"], "neither a shipped scenario"),
        (["--probes", "0"], "--probes must be >= 1"),
    ],
)
def test_bad_flags_exit_2_with_the_reason(
    extra: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pdd_main([*BASE, *extra]) == 2
    assert reason in capsys.readouterr().err


def test_a_pools_file_with_unknown_keys_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text("pools:\n  prefill: {costPerHour: 1, replicas: 3}\n")
    assert pdd_main([*BASE, "--pools", str(pools)]) == 2
    assert "pools.prefill: unknown keys ['replicas']" in capsys.readouterr().err


def test_a_small_plan_prints_both_systems_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two requests/s on the published hardware: one replica of each pool is enough, and
    a pools file's price is the one the cost uses."""
    pools = tmp_path / "pools.yaml"
    pools.write_text("scenario: published\npools:\n  main: {costPerHour: 10}\n")
    # A minute of cold caches: the tail is a cold 96K-token prompt's own prefill, hence 30 s.
    argv = [*BASE, "--pools", str(pools), "--json", "--probes", "3", "--scored-s", "30",
            "--warmup-s", "30", "--jobs", "1", "--slo-ttft-p90", "30"]  # fmt: skip
    assert pdd_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    plans = {p["kind"]: p for p in report["plans"]}
    assert set(plans) == {"pdd", "same-dc"}
    pdd = plans["pdd"]
    assert pdd["feasible"] and pdd["ttft_p90_s"] <= 30 and pdd["itl_p90_s"] <= 0.08
    replicas = pdd["replicas"]
    assert set(replicas) == {"prefill", "relay", "main"}
    cost = replicas["prefill"] * 2.0 + replicas["relay"] * 2.0 + replicas["main"] * 10 + 0.64
    assert pdd["cost_per_hour"] == pytest.approx(cost)
    assert set(plans["same-dc"]["replicas"]) == {"prefill", "decode"}
    assert plans["same-dc"]["line_gbps_needed"] is None
