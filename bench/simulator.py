"""Simulator speed: one simulated hour at 50 requests/s, then ``pdd simulate`` at 10x the fleet.

    python bench/simulator.py [--rate 50] [--duration 3600] [--system pdd] [--scale F]
                              [--big-scale 10] [--big-rate 500] [--big-duration 300]
                              [--skip-big] [--json OUT]

Run 1 is the shipped ``published`` scenario's system on its generator workload at the
given rate. The published PDD deployment's goodput search tops out near 38 offered
requests/s, so its pools are scaled by ``--scale`` (default: rate / 30) to carry the rate
with room: an overloaded run would measure retry loops, not the simulator. Prints the
workload, the build and simulation times (wall, and CPU: the one-core figure that other
processes on the machine do not inflate), simulated seconds per wall second, and the
figures of the run itself so the load is visibly sane.

Run 2 is what ``pdd simulate published --no-goodput --jobs 1`` does, on every system's
pools and the WAN line x ``--big-scale`` (the baseline's 88 GPUs become 880) at
``--big-rate`` requests/s for ``--big-duration`` simulated seconds: the same tables,
then its wall and CPU time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pdd.simulator.analysis import compare, run_system
from pdd.simulator.cli import render
from pdd.simulator.metrics import summarize
from pdd.simulator.scenario import Scenario, load_scenario

BAR_S = 60.0  # the bar: one simulated hour at 50 req/s in a minute of one core


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=50.0, help="requests/s")
    p.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
    p.add_argument("--system", default="pdd")
    p.add_argument("--scale", type=float, default=None, help="pool size factor")
    p.add_argument("--big-scale", type=float, default=10.0, help="run 2: every pool x this")
    p.add_argument("--big-rate", type=float, default=500.0, help="run 2: requests/s")
    p.add_argument("--big-duration", type=float, default=300.0, help="run 2: simulated s")
    p.add_argument("--skip-big", action="store_true", help="run 1 only")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def scaled(scenario: Scenario, systems: list[str], factor: float) -> Scenario:
    """``scenario`` with only ``systems``, each pool's instances x ``factor``. The WAN
    line stays as it is: run 1 keeps the published line (it carries the rate)."""
    specs = {}
    for name in systems:
        spec = scenario.systems[name]
        pools = {
            pool_name: pool.model_copy(update={"instances": max(1, round(pool.instances * factor))})
            for pool_name, pool in spec.pools().items()
        }
        specs[name] = spec.model_copy(update=pools)
    return scenario.model_copy(update={"systems": specs})


def one_hour(args: argparse.Namespace) -> dict[str, str]:
    scenario, base_dir = load_scenario("published")
    factor = args.scale if args.scale is not None else args.rate / 30.0
    scenario = scaled(scenario, [args.system], factor)
    workload = scenario.workload.model_copy(update={"duration_s": args.duration})
    workload = workload.with_rate(args.rate)
    started, cpu_started = time.perf_counter(), time.process_time()
    trace = workload.build(base_dir)
    built, cpu_built = time.perf_counter(), time.process_time()
    run = run_system(scenario, args.system, workload, trace)
    done, cpu_done = time.perf_counter(), time.process_time()
    figures = summarize(run, scenario.slo, scenario.billing)
    pools = {n: p.instances for n, p in scenario.systems[args.system].pools().items()}
    return {
        "system": f"{args.system}, pools x{factor:.2f} {pools}",
        "requests simulated": str(len(run.records)),
        "simulated seconds": f"{run.horizon_s:.0f}",
        "workload build wall s": f"{built - started:.1f}",
        "simulation wall s": f"{done - built:.1f}",
        "total wall s": f"{done - started:.1f}",
        "total CPU s": f"{cpu_done - cpu_started:.1f}",
        "bar (s)": f"{BAR_S:.0f}",
        "total CPU / bar": f"{(cpu_done - cpu_started) / BAR_S:.2f}",
        "simulated s per wall s": f"{run.horizon_s / (done - built):.0f}",
        "CPU ms per request": f"{1000 * (cpu_done - cpu_built) / len(run.records):.3f}",
        "run: offered req/s": f"{figures['offered_rps']:.1f}",
        "run: within SLO": f"{figures['slo_attainment']:.1%}",
        "run: TTFT p50 / p99 s": f"{figures['ttft_p50']:.2f} / {figures['ttft_p99']:.2f}",
    }


def big_fleet(args: argparse.Namespace) -> dict[str, str]:
    scenario, base_dir = load_scenario("published")
    scenario = scaled(scenario, list(scenario.systems), args.big_scale)
    # The line is sized for the published fleet: ten times the fleet behind one line
    # measures a line at 240% of its rate. Scale its capacity and price with the fleet.
    wan = scenario.wan.model_copy(
        update={
            "gbps": scenario.wan.gbps * args.big_scale,
            "price_per_hour": scenario.wan.price_per_hour * args.big_scale,
        }
    )
    scenario = scenario.model_copy(update={"wan": wan})
    workload = scenario.workload.model_copy(update={"duration_s": args.big_duration})
    scenario = scenario.model_copy(update={"workload": workload.with_rate(args.big_rate)})
    started, cpu_started = time.perf_counter(), time.process_time()
    report = compare(scenario, base_dir, lambda m: print(m, file=sys.stderr), goodput=False)
    report["wall_s"] = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    print(render(report))
    gpus = {n: sum(f["gpus"].values()) for n, f in report["systems"].items()}
    return {
        "fleet": f"every pool and the WAN line x{args.big_scale:g}, GPUs {gpus}",
        "requests per system": str(report["workload"]["requests"]),
        "offered req/s": f"{report['workload']['offered_rate_rps']:.0f}",
        "total wall s": f"{report['wall_s']:.1f}",
        "total CPU s": f"{cpu:.1f}",
    }


def print_rows(title: str, rows: dict[str, str]) -> None:
    width = max(len(k) for k in rows)
    print(title)
    for key, value in rows.items():
        print(f"  {key:<{width}}  {value}")


def main() -> None:
    args = parse_args()
    result = {"one_hour": one_hour(args)}
    print_rows("run 1: one simulated hour", result["one_hour"])
    if not args.skip_big:
        result["big_fleet"] = big_fleet(args)
        print_rows("run 2: pdd simulate at the scaled fleet", result["big_fleet"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
