from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pdd.bench import plots, report
from pdd.bench.replay import Outcome
from pdd.local.probes import by_label, delta, flatten, throughput_mbps, total

pytestmark = pytest.mark.unit


def outcome(key: str, ttft: float, text: str = "abc", error: str | None = None) -> Outcome:
    o = Outcome(key, prompt_tokens=10, max_tokens=3, ttft_s=ttft, e2e_s=ttft + 0.2, text=text)
    o.chunk_times = [ttft, ttft + 0.01, ttft + 0.3]
    o.cached_tokens, o.finish_reason, o.error = 8, "length", error
    return o


ROUTER_TEXT = """\
# TYPE pdd_router_requests counter
pdd_router_requests_total{pipeline="P-MD",reason="fits_ttft_budget"} 3.0
pdd_router_requests_total{pipeline="P-RLD-MD",reason="transfer_exceeds_budget"} 1.0
# TYPE pdd_router_output_tokens counter
pdd_router_output_tokens_total{source_role="relay"} 5.0
pdd_router_output_tokens_total{source_role="main"} 15.0
"""
WORKER_TEXT = """\
# TYPE pdd_worker_prefix_hit_tokens counter
pdd_worker_prefix_hit_tokens_total{role="prefill"} 90.0
pdd_worker_prefix_hit_tokens_total{role="main"} 45.0
# TYPE pdd_worker_prompt_tokens counter
pdd_worker_prompt_tokens_total{role="prefill"} 100.0
pdd_worker_prompt_tokens_total{role="main"} 100.0
# TYPE pdd_worker_wan_kv_bytes counter
pdd_worker_wan_kv_bytes_total 4096.0
"""


def test_prometheus_helpers_sum_by_label_and_subtract() -> None:
    s = flatten(ROUTER_TEXT)
    assert by_label(s, "pdd_router_requests_total", "pipeline") == {"P-MD": 3.0, "P-RLD-MD": 1.0}
    assert total(s, "pdd_router_output_tokens_total", source_role="relay") == 5.0
    assert total(s, "pdd_router_output_tokens_total") == 20.0
    assert delta({"a": 1.0}, {"a": 4.0, "b": 2.0}) == {"a": 3.0, "b": 2.0}
    assert throughput_mbps([(0.0, 0), (1.0, 125_000), (1.0, 125_000)]) == [(1.0, 1.0)]


def test_percentile_is_nearest_rank() -> None:
    values = [float(i) for i in range(1, 101)]
    assert report.percentile(values, 50) == 50.0
    assert report.percentile(values, 99) == 99.0
    assert report.percentile([3.0], 90) == 3.0
    assert report.percentile([], 50) is None


def test_summary_counts_errors_slo_pipelines_and_hits() -> None:
    outs = [outcome("a", 0.1), outcome("b", 0.9), outcome("c", 0.2, error="boom")]
    run = report.ModeRun("pdd", outs, wall_s=2.0, wan_bytes=2_000_000_000,
                         router=flatten(ROUTER_TEXT), workers=flatten(WORKER_TEXT))  # fmt: skip
    s = report.summarize(run, report.Slo(ttft_s=0.5, stall_s=0.5))
    assert (s["requests"], s["completed"], s["errors"]) == (3, 2, 1)
    assert s["ttft_p50"] == 0.1 and s["ttft_p99"] == 0.9
    assert s["stall_max"] == pytest.approx(0.29)
    assert s["slo_attainment"] == pytest.approx(1 / 3)  # b is too slow, c failed
    assert s["goodput_rps"] == pytest.approx(0.5)
    assert s["wan_gb"] == 2.0 and s["kv_wan_bytes_reported"] == 4096.0
    assert s["pipeline_share"] == {"P-MD": 0.75, "P-RLD-MD": 0.25}
    assert s["rld_token_share"] == 0.25
    assert (s["p_hit_ratio"], s["md_hit_ratio"]) == (0.9, 0.45)


def summary(mode: str, ttft_p50: float, ttft_p99: float, wire: float | None) -> dict:
    return {"mode": mode, "ttft_p50": ttft_p50, "ttft_p99": ttft_p99,
            "kv_wan_wire_bytes_reported": wire, "completed": 100}  # fmt: skip


def test_pdd_is_compared_with_naive_and_same_dc_against_the_floor() -> None:
    """100 requests sent 6.25 MB of KV over a 0.05 Gbit/s, 30 ms line: 62.5 KB each on
    average, 10 ms at the line's rate, so the floor is 40 ms and the target 50 ms."""
    c = report.comparisons(
        [summary("samedc", 0.04, 0.2, None), summary("naive", 0.9, 5.0, 40e6),
         summary("pdd", 0.085, 0.5, 6.25e6)],
        gbps=0.05, rtt_ms=30,
    )  # fmt: skip
    assert c["pdd_over_naive_ttft_p99"] == pytest.approx(0.1)
    assert c["pdd_over_samedc_ttft_p99"] == pytest.approx(2.5)
    assert c["pdd_minus_samedc_ttft_p50_s"] == pytest.approx(0.045)
    assert c["pmd_floor_s"] == pytest.approx(0.040)
    assert c["pmd_floor_plus_10ms_s"] == pytest.approx(0.050)
    lines = report.comparison_lines(c)
    assert lines[0] == "PDD / naive TTFT p99: 0.100"
    assert "45.0 ms" in lines[2] and "floor + 10 ms = 50.0 ms" in lines[2]


def test_only_the_comparisons_whose_modes_ran_are_made() -> None:
    c = report.comparisons([summary("naive", 0.9, 5.0, 1e6), summary("pdd", 0.1, 0.5, 1e5)],
                           gbps=0.05, rtt_ms=30)  # fmt: skip
    assert set(c) == {"pdd_over_naive_ttft_p99"}
    assert report.comparisons([summary("pdd", 0.1, 0.5, 1e5)], gbps=0.05, rtt_ms=30) == {}


def test_outputs_are_compared_against_the_first_mode() -> None:
    ref = report.ModeRun("mono", [outcome("a", 0.1), outcome("b", 0.1)], 1.0)
    same = report.ModeRun("naive", [outcome("a", 0.3), outcome("b", 0.3)], 1.0)
    odd = report.ModeRun("pdd", [outcome("a", 0.1, "abd"), outcome("b", 0.1, "x", "err")], 1.0)
    assert report.compare_outputs([ref, same, odd]) == {"mono": [], "naive": [], "pdd": ["a"]}


def test_a_lossy_codecs_differences_are_reported_as_agreement_not_hidden() -> None:
    ref = report.ModeRun("mono", [outcome("a", 0.1, "abcd"), outcome("b", 0.1, "wxyz")], 1.0)
    coded = report.ModeRun(
        "pdd", [outcome("a", 0.1, "abXd"), outcome("b", 0.1, "wxyz")], 1.0, kv_codec="int8"
    )
    assert report.agreement([ref, coded]) == {"mono": 1.0, "pdd": 7 / 8}
    summaries = [report.summarize(r, report.Slo()) for r in (ref, coded)]
    summaries[1]["mismatches"], summaries[1]["agreement"] = 1, 7 / 8
    (note,) = report.lossy_notes(summaries)  # none for mono, which is exact
    assert "lossy KV codec int8: 1 of its 2 outputs differ from mono's, 87.50%" in note
    assert "| KV codec on the WAN | none | int8 |" in report.table(summaries)


def test_table_csv_json_and_plots_are_written(tmp_path: Path) -> None:
    runs = [
        report.ModeRun("naive", [outcome("a", 0.4)], 1.0, 10, wan_series=[(0, 0), (1, 10)]),
        report.ModeRun("pdd", [outcome("a", 0.1)], 1.0, 1, wan_series=[(0, 0), (1, 1)]),
    ]
    summaries = [report.summarize(r, report.Slo()) for r in runs]
    text = report.table(summaries)
    assert "| | naive | pdd |" in text and "TTFT p99 (s) | 0.400 | 0.100 |" in text
    report.write_csv(summaries, tmp_path / "r.csv")
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert [r["mode"] for r in rows] == ["naive", "pdd"] and rows[1]["wan_bytes"] == "1"
    report.write_json({"modes": {s["mode"]: s for s in summaries}}, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["modes"]["pdd"]["ttft_p99"] == 0.1
    report.write_requests_csv(runs, tmp_path / "q.csv")
    assert len((tmp_path / "q.csv").read_text().splitlines()) == 3
    paths = plots.write_all({"a": 0.5}, runs, tmp_path)
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)
