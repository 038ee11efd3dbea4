"""The simulator's figures: TTFT CDFs, the collapse timeline, and the bathtub.

matplotlib is imported lazily (through ``pdd.simulator.figures.pyplot``) so a run without
``--plots`` never needs it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from pdd.simulator.figures import pyplot, save_figure
from pdd.simulator.metrics import scored, ttft_bounded
from pdd.simulator.runner import SystemRun
from pdd.simulator.stats import percentile


def ttft_cdf(runs: Mapping[str, SystemRun], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in runs.items():
        ttft = sorted(ttft_bounded(r, run.horizon_s) for r in scored(run))
        if ttft:
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
    ax.set_xscale("log")
    save_figure(
        plt, fig, ax, path, "TTFT CDF per system", "time to first token (s)",
        "share of requests", grid=True,
    )  # fmt: skip


def collapse_timeline(runs: Mapping[str, SystemRun], bucket_s: float, path: Path) -> None:
    """Relay load and the TTFT p99 of each time bucket's arrivals, per system: with the
    DRC off (or low-hit traffic ending at RLD) the relays saturate and TTFT runs away."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, run in runs.items():
        top.plot([s.t for s in run.samples], [s.relay_utilization for s in run.samples], label=name)
        times, p99 = _ttft_p99_series(run, bucket_s)
        bottom.plot(times, p99, label=name)
    top.set_ylabel("relay load (active / capacity)")
    top.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    top.grid(True, alpha=0.3)
    top.legend()
    bottom.set_yscale("log")
    save_figure(
        plt, fig, bottom, path, "", "simulated time (s)", "TTFT p99 of arrivals (s)", grid=True,
    )  # fmt: skip


def _ttft_p99_series(run: SystemRun, bucket_s: float) -> tuple[list[float], list[float]]:
    buckets: dict[int, list[float]] = {}
    for r in run.records:
        buckets.setdefault(int(r.arrival // bucket_s), []).append(ttft_bounded(r, run.horizon_s))
    points = [
        ((k + 0.5) * bucket_s, p99)
        for k in sorted(buckets)
        if (p99 := percentile(buckets[k], 99)) is not None
    ]
    return [t for t, _ in points], [p99 for _, p99 in points]


def bathtub(rows: Sequence[Mapping], path: Path) -> None:
    """Against the workload's mean hit rate: benefit (revenue within SLO per hardware $,
    cached input billed at its discount) and BCR (goodput within SLO per $/h)."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    names = list(rows[0]["systems"]) if rows else []
    xs = [row["mean_hit_rate"] for row in rows]
    for name in names:
        for ax, key in ((top, "benefit"), (bottom, "bcr")):
            ys = [row["systems"][name][key] for row in rows]
            ax.plot(xs, [y if y > 0 else math.nan for y in ys], marker="o", label=name)
    top.set_ylabel("revenue within SLO / hardware $")
    top.set_title("Benefit against mean hit rate")
    top.grid(True, alpha=0.3)
    top.legend()
    save_figure(
        plt, fig, bottom, path, "", "mean prefix hit rate",
        "goodput within SLO per $/h", grid=True,
    )  # fmt: skip


def write_all(report: Mapping, bucket_s: float, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: Mapping[str, SystemRun] = report["_runs"]
    paths = [out_dir / "ttft_cdf.png"]
    ttft_cdf(runs, paths[0])
    if any(run.spec.relay is not None for run in runs.values()):
        paths.append(out_dir / "relay_timeline.png")
        collapse_timeline(runs, bucket_s, paths[-1])
    if report.get("sweep"):
        paths.append(out_dir / "bathtub.png")
        bathtub(report["sweep"], paths[-1])
    return paths
