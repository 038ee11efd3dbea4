"""``pdd simulate SCENARIO [--json OUT] [--plots DIR]``: run a scenario and print its tables.

SCENARIO is a shipped name (``pdd simulate --list``) or a path to a YAML file. Relative
trace paths resolve against ``--traces DIR`` when given, else against the trace sample
committed at ``bench/traces/`` (shipped scenarios) or the YAML file's folder. The
JSON report holds, per system, ``ttft_p50``, ``ttft_p99``, ``goodput_rps``, ``cost``,
``bcr`` and ``rld_token_share`` (among others), plus ``bcr_gain`` and ``cost_saving``
of ``pdd`` over ``baseline``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from pdd.common.settings import parser as settings_parser
from pdd.local.traces.base import TraceFormatError
from pdd.simulator import plots
from pdd.simulator.analysis import compare, sweep
from pdd.simulator.generator import GeneratorSpec
from pdd.simulator.scenario import Scenario, ScenarioError, load_scenario, shipped_scenarios

COLUMNS = (
    ("ttft_p50", "TTFT p50 s", "{:.2f}"),
    ("ttft_p90", "p90", "{:.2f}"),
    ("ttft_p99", "p99", "{:.2f}"),
    ("tpot_p50", "TPOT p50 ms", "{:.0f}", 1000),
    ("slo_attainment", "in SLO", "{:.1%}"),
    ("goodput_rps", "goodput rps", "{:.3g}"),
    ("cost", "cost $/h", "{:.2f}"),
    ("bcr", "BCR", "{:.3f}"),
    ("benefit", "benefit", "{:.2f}"),
    ("wan_utilization", "WAN util", "{:.1%}"),
    ("rld_token_share", "RLD tokens", "{:.1%}"),
    ("relay_overload_share", "RLD full", "{:.0%}"),
    ("md_hit_ratio", "MD hit", "{:.2f}"),
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser("pdd simulate", __doc__.splitlines()[0])
    p.add_argument("scenario", nargs="?", help="shipped name or path to a .yaml scenario")
    p.add_argument("--list", action="store_true", help="list the shipped scenarios")
    p.add_argument("--json", type=Path, help="write the full report here")
    p.add_argument("--plots", type=Path, help="write PNG figures into this folder")
    p.add_argument("--no-goodput", action="store_true", help="skip the goodput rate search")
    p.add_argument("--duration", type=float, help="override the generator's duration_s")
    p.add_argument("--rate", type=float, help="override the workload's arrival rate")
    p.add_argument(
        "--traces",
        type=Path,
        metavar="DIR",
        help="resolve relative trace paths against DIR, e.g. the full published traces "
        "(default: the bundled sample bench/traces/ for shipped scenarios, else the "
        "scenario file's folder)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="systems simulated in parallel"
    )
    return p


def apply_overrides(
    scenario: Scenario, args: argparse.Namespace, base_dir: Path | None = None
) -> Scenario:
    """The scenario with --duration and --rate applied (``base_dir``: where the
    workload's relative trace path resolves, as for ``build``)."""
    workload = scenario.workload
    if args.duration is not None:
        if not isinstance(workload, GeneratorSpec):
            raise ScenarioError("--duration applies to generator workloads only")
        workload = workload.model_copy(update={"duration_s": args.duration})
    if args.rate is not None:
        workload = workload.with_rate(args.rate, base_dir)
    return scenario.model_copy(update={"workload": workload})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list or not args.scenario:
        print("shipped scenarios: " + ", ".join(shipped_scenarios()))
        return 0 if args.list else 2
    progress = (lambda _: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    started = time.perf_counter()
    try:
        scenario, base_dir = load_scenario(args.scenario, args.traces)
        scenario = apply_overrides(scenario, args, base_dir)
        report = compare(scenario, base_dir, progress, not args.no_goodput, max(1, args.jobs))
        if scenario.sweep is not None:
            report["sweep"] = sweep(scenario, base_dir, progress)
    except (ScenarioError, TraceFormatError, ValidationError, ValueError) as exc:
        print(f"pdd simulate: {exc}", file=sys.stderr)
        return 2
    report["wall_s"] = time.perf_counter() - started
    print(render(report))
    if args.plots:
        for path in plots.write_all(report, scenario.run.sample_s * 6, args.plots):
            print(f"wrote {path}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(jsonable(report), indent=2))
        print(f"wrote {args.json}")
    return 0


def jsonable(report: dict) -> dict:
    """The report without the raw runs, with non-finite numbers as null (strict JSON)."""

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if not str(k).startswith("_")}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    return clean(report)


def render(report: dict) -> str:
    """The systems side by side, then the headline ratios."""
    w = report["workload"]
    lines = [
        f"scenario {report['scenario']}: {w['requests']} requests at "
        f"{w['offered_rate_rps']:.1f} req/s, mean ideal hit {w['ideal_mean_hit']:.2f}",
        "",
    ]
    header = ["system"] + [c[1] for c in COLUMNS]
    rows = [header]
    for name, figures in report["systems"].items():
        row = [name]
        for key, _, fmt, *scale in COLUMNS:
            value = figures.get(key)
            row.append("-" if value is None else fmt.format(value * (scale[0] if scale else 1)))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(widths[i]) for i, cell in enumerate(r)) for r in rows]
    lines.append("")
    for name, figures in report["systems"].items():
        lines.append(f"{name}: pipelines {figures['pipelines']} handoffs {figures['handoffs']}")
    lines += _headline_lines(report)
    lines.append(f"wall time {report['wall_s']:.1f} s")
    return "\n".join(lines)


def _headline_lines(report: dict) -> list[str]:
    out = [""]
    if report.get("bcr_gain") is not None:
        out.append(
            f"PDD vs same-DC baseline: BCR {report['bcr_gain']:+.1%}, "
            f"goodput {report['goodput_gain']:+.1%}, cost {-report['cost_saving']:+.1%}"
        )
    for row in report.get("cost_by_premium", []):
        out.append(
            f"  GPU-B at +{row['premium']:.0%}: PDD ${row['pdd_cost']:.2f}/h vs "
            f"${row['baseline_cost']:.2f}/h, {row['saving']:.2%} cheaper"
        )
    if report.get("ttft_p99_vs_naive") is not None:
        out.append(f"PDD TTFT p99 / naive cross-DC PD TTFT p99: {report['ttft_p99_vs_naive']:.2f}x")
    for row in report.get("sweep", []):
        cells = ", ".join(
            f"{n} {s['goodput_rps']:.2f} rps, BCR {s['bcr']:.3f}, benefit {s['benefit']:.2f}"
            for n, s in row["systems"].items()
        )
        out.append(f"mean hit {row['mean_hit_rate']:.2f}: {cells}")
    return out
