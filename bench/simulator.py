"""Simulator speed: one simulated hour at 50 requests/s, wall time against the 2-minute bar.

    python bench/simulator.py [--rate 50] [--duration 3600] [--system pdd] [--json OUT]

Runs the shipped ``published`` scenario's system on its generator workload at the given
rate. The published PDD deployment's goodput search tops out near 38 offered requests/s,
so its pools are scaled by ``--scale`` (default: rate / 30) to carry the rate with room:
an overloaded run would measure retry loops, not the simulator. Prints the workload,
the build and simulation wall times, simulated seconds per wall second, and the figures
of the run itself so the load is visibly sane.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pdd.simulator.analysis import run_system
from pdd.simulator.metrics import summarize
from pdd.simulator.scenario import Scenario, load_scenario

BAR_S = 120.0  # the bar: one simulated hour at 50 req/s in under two minutes


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=50.0, help="requests/s")
    p.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
    p.add_argument("--system", default="pdd")
    p.add_argument("--scale", type=float, default=None, help="pool size factor")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def scaled(scenario: Scenario, system: str, factor: float) -> Scenario:
    spec = scenario.systems[system]
    pools = {
        name: pool.model_copy(update={"instances": max(1, round(pool.instances * factor))})
        for name, pool in spec.pools().items()
    }
    return scenario.model_copy(update={"systems": {system: spec.model_copy(update=pools)}})


def main() -> None:
    args = parse_args()
    scenario, base_dir = load_scenario("published")
    factor = args.scale if args.scale is not None else args.rate / 30.0
    scenario = scaled(scenario, args.system, factor)
    workload = scenario.workload.model_copy(update={"duration_s": args.duration})
    workload = workload.with_rate(args.rate)
    started = time.perf_counter()
    trace = workload.build(base_dir)
    built = time.perf_counter()
    run = run_system(scenario, args.system, workload, trace)
    done = time.perf_counter()
    figures = summarize(run, scenario.slo, scenario.billing)
    pools = {n: p.instances for n, p in scenario.systems[args.system].pools().items()}
    rows = {
        "system": f"{args.system}, pools x{factor:.2f} {pools}",
        "requests simulated": len(run.records),
        "simulated seconds": f"{run.horizon_s:.0f}",
        "workload build wall s": f"{built - started:.1f}",
        "simulation wall s": f"{done - built:.1f}",
        "total wall s": f"{done - started:.1f}",
        "bar (s)": f"{BAR_S:.0f}",
        "total / bar": f"{(done - started) / BAR_S:.2f}",
        "simulated s per wall s": f"{run.horizon_s / (done - built):.0f}",
        "wall ms per request": f"{1000 * (done - built) / len(run.records):.3f}",
        "run: offered req/s": f"{figures['offered_rps']:.1f}",
        "run: within SLO": f"{figures['slo_attainment']:.1%}",
        "run: TTFT p50 / p99 s": f"{figures['ttft_p50']:.2f} / {figures['ttft_p99']:.2f}",
    }
    width = max(len(k) for k in rows)
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
