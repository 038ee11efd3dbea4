"""``pdd plan-day [--peak-rps R] [--hours H] [--json OUT]
[--plots DIR]``: the simulated day (:mod:`pdd.simulator.planner.day`), planner vs static
provisioning for the peak vs today's RLD-only HPA, on the published setup's model and
hardware; per 5-minute window SLO attainment, GPU-hours and cost."""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pdd.common.settings import parser as settings_parser
from pdd.local.traces.base import Trace, TraceRequest
from pdd.simulator.generator import GeneratorSpec
from pdd.simulator.planner import day
from pdd.simulator.planner.capacity import size
from pdd.simulator.planner.capacity_plan import first_guess
from pdd.simulator.planner.deployment import default_bounds, deployment_model
from pdd.simulator.planner.load import Slo
from pdd.simulator.planner.planner import Planner
from pdd.simulator.planner.predict import LinearTrend
from pdd.simulator.scenario import Scenario, load_scenario

SYSTEM = "pdd"


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser("pdd plan-day", __doc__.splitlines()[0])
    p.add_argument("--peak-rps", type=float, default=4.0, help="request rate at the peak")
    p.add_argument("--hours", type=float, default=24.0, help="simulated hours (a day: 24)")
    p.add_argument("--slo-ttft-p90", type=float, default=10.0,
                   help="TTFT target at P90, seconds, queue time included")
    p.add_argument("--slo-itl-p90", type=float, default=0.08,
                   help="inter-token latency target at P90, seconds")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--plots", type=Path, help="write the figures into this folder")
    p.add_argument("--jobs", type=int, default=2,
                   help="processes for the static and RLD-HPA runs (beside the planner's)")
    return p


def setup(peak_rps: float, hours: float) -> tuple[Scenario, GeneratorSpec]:
    scenario, _ = load_scenario("published")
    spec = scenario.workload
    assert isinstance(spec, GeneratorSpec)
    spec = spec.model_copy(update={"rate_rps": peak_rps})
    run = scenario.run.model_copy(update={"warmup_s": 0.0, "drain_s": 600.0})
    return scenario.model_copy(update={"workload": spec, "run": run}), spec


def _trace(spec: GeneratorSpec, hours: float) -> Trace[TraceRequest]:
    return day.day_trace(spec, day.DayShape(), hours * 3600)


def run_planner(peak_rps: float, hours: float, slo: Slo) -> dict:
    scenario, spec = setup(peak_rps, hours)
    trace = _trace(spec, hours)
    model, bounds = deployment_model(scenario, SYSTEM), default_bounds(scenario, SYSTEM)
    start_load = first_guess(trace, peak_rps * day.DayShape().level(0.0))
    start = {n: bounds[n].clamp(c or 1) for n, c in size(model, start_load, slo).items()}
    planner = Planner(model, bounds, slo, LinearTrend(3))
    scaler = day.Autoscaler(day.planner_decide(planner, 60.0))
    records, scaler = day.run_one(scenario, SYSTEM, start, trace, scaler)
    return _summary("planner", records, scaler, slo, hours)


def run_fixed(name: str, peak_rps: float, hours: float, slo: Slo, counts: dict) -> dict:
    scenario, spec = setup(peak_rps, hours)
    trace = _trace(spec, hours)
    if name == "static":
        decide = day.fixed(counts)
    else:
        decide = day.relay_hpa(counts, target_load=0.7, max_relays=64)
    records, scaler = day.run_one(scenario, SYSTEM, counts, trace, day.Autoscaler(decide))
    return _summary(name, records, scaler, slo, hours)


def _summary(name: str, records: list, scaler: day.Autoscaler, slo: Slo, hours: float) -> dict:
    windows = day.windows(records, slo, hours * 3600 + 600)
    return {
        "system": name,
        "requests": len(records),
        "windows": windows,
        "windows_met": sum(w["met"] for w in windows) / max(1, len(windows)),
        "gpu_hours": scaler.gpu_hours,
        "cost": scaler.cost,
        "timeline": scaler.timeline,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    slo = Slo(args.slo_ttft_p90, args.slo_itl_p90)
    started = time.perf_counter()
    planned = run_planner(args.peak_rps, args.hours, slo)
    pools = [k for k in planned["timeline"][0] if k != "t"]
    peak = {n: max(row[n] for row in planned["timeline"]) for n in pools}
    with ProcessPoolExecutor(max(1, min(2, args.jobs))) as pool:
        futures = [
            pool.submit(run_fixed, name, args.peak_rps, args.hours, slo, peak)
            for name in ("static", "rld-hpa")
        ]
        others = [f.result() for f in futures]
    report = {"peak_rps": args.peak_rps, "hours": args.hours, "static_counts": peak,
              "systems": [planned, *others], "wall_s": time.perf_counter() - started}  # fmt: skip
    print(render(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report))
    if args.plots:
        from pdd.simulator.planner.day_plots import write_all

        for path in write_all(report, args.plots):
            print(f"wrote {path}")
    return 0


def render(report: dict) -> str:
    static = next(s for s in report["systems"] if s["system"] == "static")
    lines = ["system     requests  windows met  GPU-hours  vs static  cost $"]
    for s in report["systems"]:
        share = s["gpu_hours"] / static["gpu_hours"] if static["gpu_hours"] else 0.0
        lines.append(
            f"{s['system']:<10} {s['requests']:>8}  {s['windows_met']:>10.1%}  "
            f"{s['gpu_hours']:>9.1f}  {share:>9.0%}  {s['cost']:>6.0f}"
        )
    lines.append(f"static counts {report['static_counts']}; wall time {report['wall_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
