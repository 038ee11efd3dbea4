"""``pdd simulate``: the report's interface, strict JSON, clear errors; the bathtub sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdd.cli import main as pdd_main
from pdd.simulator.analysis import sweep
from pdd.simulator.scenario import BillingSpec, load_scenario

#: Tiers per test: some tests here start processes (integration), the rest are unit.


@pytest.mark.integration
def test_simulate_writes_strict_json_with_the_per_system_figures(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    rc = pdd_main(["simulate", "collapse", "--no-goodput", "--duration", "300", "--quiet",
                   "--json", str(out), "--plots", str(tmp_path / "figs")])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "drc-off" in printed and "TTFT p50 s" in printed
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON for other tools
    report = json.loads(text)
    for figures in report["systems"].values():
        for key in ("ttft_p50", "ttft_p99", "goodput_rps", "cost", "bcr", "rld_token_share"):
            assert isinstance(figures[key], int | float), key
    assert (tmp_path / "figs" / "ttft_cdf.png").stat().st_size > 0
    assert (tmp_path / "figs" / "relay_timeline.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "no-such"], "shipped ones are"),
        (["simulate", "mooncake", "--duration", "10"], "generator workloads only"),
    ],
)
@pytest.mark.unit
def test_bad_input_exits_2_with_one_line(argv: list[str], message: str, capsys) -> None:
    assert pdd_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.unit
def test_traces_points_a_shipped_scenario_at_another_folder(tmp_path: Path, capsys) -> None:
    """--traces DIR replaces the bundled sample, for the run and for --rate alike."""
    sample = Path(__file__).resolve().parents[2] / "bench" / "traces" / "mooncake"
    lines = (sample / "conversation_trace.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "conversation_trace.jsonl").write_text("".join(lines[:40]))
    out = tmp_path / "r.json"
    argv = ["simulate", "mooncake", "--traces", str(tmp_path), "--rate", "4", "--no-goodput",
            "--quiet", "--jobs", "1", "--json", str(out)]  # fmt: skip
    assert pdd_main(argv) == 0, capsys.readouterr().err
    workload = json.loads(out.read_text())["workload"]
    assert workload["requests"] == 40
    assert workload["offered_rate_rps"] == pytest.approx(4.0, rel=0.01)
    missing = ["simulate", "mooncake", "--traces", str(tmp_path / "none"), "--quiet"]
    assert pdd_main(missing) == 2
    assert str(tmp_path / "none" / "mooncake") in capsys.readouterr().err


@pytest.mark.unit
def test_list_names_the_shipped_scenarios(capsys) -> None:
    assert pdd_main(["simulate", "--list"]) == 0
    assert "published" in capsys.readouterr().out


@pytest.mark.unit
def test_revenue_bills_cached_input_at_its_discount() -> None:
    billing = BillingSpec(input_per_mtok=2.0, cached_input_ratio=0.25, output_per_mtok=8.0)
    # 1M input of which 900k cached, 100k output: (100k + 225k) x $2/M + 100k x $8/M
    assert billing.revenue(1_000_000, 900_000, 100_000) == pytest.approx(0.65 + 0.8)


@pytest.mark.unit
def test_the_sweep_reports_every_system_at_every_mean_hit_rate() -> None:
    scenario, base = load_scenario("bathtub")
    small = scenario.model_copy(
        update={
            "workload": scenario.workload.model_copy(update={"duration_s": 200}),
            "run": scenario.run.model_copy(update={"warmup_s": 50}),
            "sweep": scenario.sweep.model_copy(
                update={"mean_hit_rates": (0.1, 0.95), "goodput_probes": 1}
            ),
        }
    )
    rows = sweep(small, base)
    assert [row["mean_hit_rate"] for row in rows] == [0.1, 0.95]
    for row in rows:
        assert set(row["systems"]) == {"baseline", "pdd"}
        for figures in row["systems"].values():
            assert figures["cost"] > 0 and figures["goodput_rps"] >= 0
    # More of each prompt is cached at the higher mean: P's measured hit follows the sweep.
    low, high = (row["systems"]["pdd"]["p_hit_ratio"] for row in rows)
    assert high > low + 0.4
