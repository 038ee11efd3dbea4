"""The simulated day's figures: replicas per pool over the day beside the load, and each
5-minute window's client TTFT P90 per system against the SLO."""

from __future__ import annotations

from pathlib import Path

from pdd.simulator.figures import pyplot, save_figure


def replicas(report: dict, path: Path) -> None:
    """The planner's replicas per pool, and the requests per window (right axis)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    planner = next(s for s in report["systems"] if s["system"] == "planner")
    hours = [row["t"] / 3600 for row in planner["timeline"]]
    for pool, label in (("prefill", "P"), ("relay", "RLD"), ("main", "MD")):
        ax.step(hours, [row[pool] for row in planner["timeline"]], where="post", label=label)
    load = ax.twinx()
    windows = planner["windows"]
    load.plot([w["t"] / 3600 for w in windows], [w["requests"] / 300 for w in windows],
              color="grey", alpha=0.4)  # fmt: skip
    load.set_ylabel("requests/s (grey)")
    save_figure(plt, fig, ax, path, "planner: replicas per pool over the day", "hour",
                "replicas", grid=True)  # fmt: skip


def ttft(report: dict, slo_s: float, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for s in report["systems"]:
        ws = s["windows"]
        ax.plot([w["t"] / 3600 for w in ws], [w["ttft_p90_s"] for w in ws], label=s["system"],
                alpha=0.8)  # fmt: skip
    ax.axhline(slo_s, color="red", linestyle="--", label="SLO")
    ax.set_yscale("log")
    save_figure(plt, fig, ax, path, "client TTFT P90 per 5-minute window", "hour",
                "TTFT P90 (s), queue time included", grid=True)  # fmt: skip


def write_all(report: dict, folder: Path, slo_s: float = 10.0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "day_replicas.png", folder / "day_ttft.png"]
    replicas(report, paths[0])
    ttft(report, slo_s, paths[1])
    return paths
