"""A scenario's analyses: every system at the offered load, goodput by rate search, the
hit-rate sweep (the bathtub), and the headline ratios between systems.

Goodput follows DistServe: the highest arrival rate at which ``attainment`` of the
requests meet both the TTFT and the TPOT SLO, found by bisection on the workload's
rate. The benefit-cost ratio is that goodput per dollar-hour of hardware.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pdd.local.traces.base import Trace, TraceRequest
from pdd.simulator.costs import cost_at_premium, gpu_counts, system_cost_per_hour
from pdd.simulator.generator import GeneratorSpec
from pdd.simulator.metrics import summarize
from pdd.simulator.runner import SystemRun, simulate
from pdd.simulator.scenario import Scenario
from pdd.simulator.workload import WorkloadSpec, describe

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


@dataclass
class GoodputSearch:
    rate_rps: float  # the highest offered rate that met the attainment target (0: none did)
    goodput_rps: float  # requests/s served within the SLO at that rate
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment)
    best: dict = field(default_factory=dict)  # the figures of the run at that rate


def run_system(
    scenario: Scenario, name: str, workload: WorkloadSpec, trace: Trace[TraceRequest]
) -> SystemRun:
    """One system on ``trace`` (built from ``workload``), scored over the generator's
    window, or the trace's own."""
    until = workload.duration_s if isinstance(workload, GeneratorSpec) else None
    return simulate(scenario, name, trace, until)


def search_goodput(
    scenario: Scenario, system: str, base_dir: Path | None, progress: Progress = _quiet
) -> GoodputSearch:
    """Bisect the arrival rate for the highest one whose SLO attainment meets the target:
    ``rate_low`` first, then halfway toward ``rate_high`` after a pass, or toward zero
    after a fail."""
    spec = scenario.goodput
    if spec is None:
        raise ValueError("the scenario has no goodput section")
    workload = scenario.workload
    if spec.duration_s is not None and isinstance(workload, GeneratorSpec):
        workload = workload.model_copy(update={"duration_s": spec.duration_s})
    result = GoodputSearch(0.0, 0.0)
    low, high = 0.0, spec.rate_high
    for i in range(spec.probes):
        rate = spec.rate_low if i == 0 else (low + high) / 2
        probe = workload.with_rate(rate, base_dir)
        run = run_system(scenario, system, probe, probe.build(base_dir))
        figures = summarize(run, scenario.slo, scenario.billing)
        achieved = figures["slo_attainment"]
        result.probes.append((rate, achieved))
        progress(f"  {system}: {rate:.2f} req/s -> {achieved:.1%} within SLO")
        if achieved >= spec.attainment:
            low = result.rate_rps = rate
            result.goodput_rps, result.best = figures["slo_goodput_rps"], figures
        else:
            high = rate
    return result


def compare(
    scenario: Scenario,
    base_dir: Path | None,
    progress: Progress = _quiet,
    goodput: bool = True,
    jobs: int = 1,
) -> dict:
    """Every system at the scenario's load (and, when asked, its goodput); the report.

    Systems are independent simulations, so ``jobs`` > 1 runs them in that many worker
    processes (their progress lines are then printed to stderr by the workers)."""
    trace = scenario.workload.build(base_dir)
    report: dict = {
        "scenario": scenario.name,
        "description": scenario.description,
        "workload": describe(
            trace,
            scenario.router.anomalous_min_input_tokens,
            scenario.router.anomalous_output_tokens_below,
        ),
        "slo": scenario.slo.model_dump(),
        "systems": {},
    }
    names = list(scenario.systems)
    if jobs > 1 and len(names) > 1:
        verbose = progress is not _quiet
        with ProcessPoolExecutor(min(jobs, len(names))) as pool:
            futures = [
                pool.submit(evaluate_system, scenario, n, trace, base_dir, goodput, verbose)
                for n in names
            ]
            results = [f.result() for f in futures]
    else:
        results = [evaluate_system(scenario, n, trace, base_dir, goodput, progress) for n in names]
    runs: dict[str, SystemRun] = {}
    for name, (figures, run) in zip(names, results, strict=True):
        report["systems"][name], runs[name] = figures, run
    report.update(headline(scenario, report["systems"]))
    report["timeseries"] = {name: [s.__dict__ for s in run.samples] for name, run in runs.items()}
    report["_runs"] = runs  # for plots; dropped before JSON
    return report


def evaluate_system(
    scenario: Scenario,
    name: str,
    trace: Trace[TraceRequest],
    base_dir: Path | None,
    goodput: bool,
    progress: Progress | bool = _quiet,
) -> tuple[dict, SystemRun]:
    """One system's figures on ``trace`` (the scenario's workload), plus its goodput when
    asked. ``progress`` may be a bool (in a worker process: print to stderr or not)."""
    if isinstance(progress, bool):
        progress = _stderr if progress else _quiet
    progress(f"{name}: simulating {len(trace)} requests")
    run = run_system(scenario, name, scenario.workload, trace)
    figures = summarize(run, scenario.slo, scenario.billing)
    figures["gpus"] = gpu_counts(scenario.systems[name])
    figures["cost"] = figures.pop("cost_per_hour")
    if goodput and scenario.goodput is not None:
        search = search_goodput(scenario, name, base_dir, progress)
        figures["goodput_rps"] = search.goodput_rps
        figures["goodput_rate_rps"] = search.rate_rps
        figures["goodput_probes"] = search.probes
    else:
        figures["goodput_rps"] = figures["slo_goodput_rps"]
    figures["bcr"] = figures["goodput_rps"] / figures["cost"] if figures["cost"] else 0.0
    return figures, run


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def headline(scenario: Scenario, systems: dict[str, dict]) -> dict:
    """pdd against baseline (BCR gain, cost saving, premium table) and against naive."""
    out: dict = {}
    pdd, base, naive = systems.get("pdd"), systems.get("baseline"), systems.get("naive")
    if pdd and base:
        out["bcr_gain"] = pdd["bcr"] / base["bcr"] - 1 if base["bcr"] else None
        out["goodput_gain"] = (
            pdd["goodput_rps"] / base["goodput_rps"] - 1 if base["goodput_rps"] else None
        )
        out["cost_saving"] = 1 - pdd["cost"] / base["cost"]
        if scenario.premium_range is not None:
            out["cost_by_premium"] = [
                _premium_row(scenario, premium) for premium in scenario.premium_range
            ]
    if pdd and naive and naive["ttft_p99"]:
        out["ttft_p99_vs_naive"] = pdd["ttft_p99"] / naive["ttft_p99"]
    return out


def _premium_row(scenario: Scenario, premium: float) -> dict:
    point = cost_at_premium(
        scenario, scenario.systems["baseline"], scenario.systems["pdd"], premium
    )
    return {
        "premium": premium,
        "baseline_cost": point.baseline_cost,
        "pdd_cost": point.candidate_cost,
        "saving": point.saving,
    }


def sweep(scenario: Scenario, base_dir: Path | None, progress: Progress = _quiet) -> list[dict]:
    """The bathtub: each system's goodput, BCR and benefit (revenue within SLO per hardware
    dollar, at its goodput rate) at each mean hit rate of the generator."""
    spec = scenario.sweep
    if spec is None or not isinstance(scenario.workload, GeneratorSpec):
        return []
    rows = []
    for mean in spec.mean_hit_rates:
        point = scenario.model_copy(update={"workload": scenario.workload.with_mean_hit(mean)})
        if point.goodput is not None:
            point = point.model_copy(
                update={"goodput": point.goodput.model_copy(update={"probes": spec.goodput_probes})}
            )
        row: dict = {"mean_hit_rate": mean, "systems": {}}
        for name in scenario.systems:
            progress(f"sweep mean hit {mean:.2f}: {name}")
            search = search_goodput(point, name, base_dir, progress)
            cost = system_cost_per_hour(point, point.systems[name])
            row["systems"][name] = {
                "goodput_rps": search.goodput_rps,
                "cost": cost,
                "bcr": search.goodput_rps / cost if cost else 0.0,
                "benefit": search.best.get("benefit", 0.0),
                "p_hit_ratio": search.best.get("p_hit_ratio", 0.0),
            }
        rows.append(row)
    return rows
