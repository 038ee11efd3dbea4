"""``pdd plan --trace T --rate R --slo-ttft-p90 S --slo-itl-p90 S [--pools FILE] [--json]``:
the cheapest P/RLD/MD replicas (and the line they need) that meet a TTFT and ITL P90 SLO,
beside same-datacenter PD sized for the same SLO, found by simulating the deployment.

T is a shipped scenario (its workload), a scenario .yaml, or a trace file or folder.
FILE is a YAML mapping: ``scenario`` (the model, GPUs, line and pool shapes; default
``published``) and ``pools``, per pool name (prefill, relay, main, decode) any of
``costPerHour``, ``minReplicas``, ``maxReplicas`` (default: the GPUs' price, 1, and 4x
the scenario's count or 64).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import yaml
from pydantic import ValidationError

from pdd.common.settings import parser as settings_parser
from pdd.local.traces.base import TraceFormatError
from pdd.simulator.planner.capacity_plan import (
    ProbeWindow,
    SystemPlan,
    pdd_and_same_dc,
    plan_both,
    probe_scenario,
)
from pdd.simulator.planner.deployment import default_bounds
from pdd.simulator.planner.load import LoadError, Slo
from pdd.simulator.planner.pools import PoolBounds
from pdd.simulator.scenario import Scenario, ScenarioError, load_scenario, shipped_scenarios
from pdd.simulator.workload import TraceSpec, WorkloadError, WorkloadSpec

_BOUND_KEYS = {"costPerHour": "cost_per_hour", "minReplicas": "min_replicas",
               "maxReplicas": "max_replicas"}  # fmt: skip


class PlanInputError(ValueError):
    """A flag or pools file the planner cannot use; the message says which and why."""


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser("pdd plan", __doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="shipped scenario, scenario .yaml, or trace")
    p.add_argument("--rate", type=float, required=True, help="offered requests per second")
    p.add_argument("--slo-ttft-p90", type=float, required=True, help="TTFT P90 target, seconds")
    p.add_argument("--slo-itl-p90", type=float, required=True, help="ITL P90 target, seconds")
    p.add_argument("--pools", type=Path, help="YAML: scenario and per-pool cost and bounds")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--probes", type=int, default=ProbeWindow.max_probes,
                   help="simulations per system after the first guess")  # fmt: skip
    p.add_argument("--scored-s", type=float, default=ProbeWindow.scored_s,
                   help="simulated seconds scored per probe (after a warm-up)")  # fmt: skip
    p.add_argument("--warmup-s", type=float,
                   help="simulated warm-up per probe (default: run.warmup_s)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=2, help="systems planned in parallel")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    try:
        scenario, base_dir, systems, slo = _inputs(args)
        window = ProbeWindow(args.warmup_s, args.scored_s, max_probes=args.probes)
        scenario = probe_scenario(scenario, scenario.workload, window)
        plans = plan_both(scenario, systems, slo, base_dir, window, max(1, args.jobs))
    except (PlanInputError, ScenarioError, LoadError, TraceFormatError, WorkloadError,
            ValidationError) as exc:  # fmt: skip
        print(f"pdd plan: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - started
    report = {"rate_rps": args.rate, "slo": {"ttft_p90_s": slo.ttft_p90_s,
              "itl_p90_s": slo.itl_p90_s}, "plans": [p.as_json() for p in plans],
              "wall_s": wall}  # fmt: skip
    print(json.dumps(_finite(report), indent=2) if args.json else render(plans, wall))
    return 0


def _inputs(
    args: argparse.Namespace,
) -> tuple[Scenario, Path | None, dict[str, dict[str, PoolBounds]], Slo]:
    if not (args.rate > 0 and math.isfinite(args.rate)):
        raise PlanInputError(f"--rate must be a positive number, got {args.rate}")
    if args.probes < 1 or args.scored_s <= 0 or (args.warmup_s or 0) < 0:
        raise PlanInputError("--probes must be >= 1, --scored-s positive, --warmup-s >= 0")
    slo = Slo(args.slo_ttft_p90, args.slo_itl_p90)
    doc = _pools_doc(args.pools)
    setup, base_dir = load_scenario(str(doc.get("scenario", "published")))
    workload, trace_dir = _workload(args.trace)
    workload = workload.with_rate(args.rate, trace_dir)
    scenario = setup.model_copy(update={"workload": workload})
    names = pdd_and_same_dc(scenario)
    overrides = doc.get("pools") or {}
    systems = {name: _bounds(scenario, name, overrides) for name in names}
    return scenario, trace_dir if trace_dir is not None else base_dir, systems, slo


def _pools_doc(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PlanInputError(f"{path}: cannot read the pools file ({exc})") from exc
    if not isinstance(doc, dict) or not set(doc) <= {"scenario", "pools"}:
        raise PlanInputError(f"{path}: a mapping with 'scenario' and/or 'pools' is expected")
    return doc


def _workload(trace: str) -> tuple[WorkloadSpec, Path | None]:
    """A scenario's workload (shipped name or .yaml), or a recorded trace at a path."""
    if trace in shipped_scenarios() or trace.endswith((".yaml", ".yml")):
        scenario, base_dir = load_scenario(trace)
        return scenario.workload, base_dir
    path = Path(trace)
    if not path.exists():
        raise PlanInputError(
            f"--trace {trace!r} is neither a shipped scenario {shipped_scenarios()}, "
            "a .yaml scenario, nor a trace file or folder"
        )
    return TraceSpec.model_validate({"path": path.resolve()}), None


def _bounds(scenario: Scenario, system: str, overrides: dict) -> dict[str, PoolBounds]:
    """The system's pools' defaults with the pools file's per-pool overrides applied."""
    bounds = default_bounds(scenario, system)
    for pool, values in overrides.items():
        if pool not in bounds:
            continue  # a pool of the other system
        unknown = set(values or {}) - set(_BOUND_KEYS)
        if unknown:
            raise PlanInputError(f"pools.{pool}: unknown keys {sorted(unknown)}")
        current = bounds[pool]
        update = {_BOUND_KEYS[k]: v for k, v in (values or {}).items()}
        bounds[pool] = PoolBounds(**{**current.__dict__, **update})
    return bounds


def render(plans: list[SystemPlan], wall_s: float) -> str:
    """The systems side by side: replicas, cost, the P90s reached, the line needed."""
    header = ["system", "P", "RLD", "MD / D", "$/h", "TTFT p90 s", "ITL p90 ms",
              "line Gbps", "verdict"]  # fmt: skip
    rows = [header]
    for p in plans:
        decode = p.counts.get("main", p.counts.get("decode", 0))
        line = "-" if p.line_gbps_needed is None else f"{p.line_gbps_needed:.1f}"
        rows.append([
            f"{p.system} ({p.kind})", str(p.counts["prefill"]), str(p.counts.get("relay", "-")),
            str(decode), f"{p.cost_per_hour:.2f}", f"{p.outcome.ttft_p90_s:.2f}",
            f"{p.outcome.itl_p90_s * 1000:.0f}", line, p.verdict,
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(widths[i]) for i, cell in enumerate(r)) for r in rows]
    lines.append(f"{sum(len(p.probes) for p in plans)} simulations, wall time {wall_s:.1f} s")
    return "\n".join(lines)


def _finite(value: object) -> object:
    """Strict JSON: non-finite numbers as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
