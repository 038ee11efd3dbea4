"""PNG plots for people: TTFT CDF per mode, per-request hit ratios, WAN throughput.

matplotlib is imported inside each function (with the Agg backend, through
``pdd.simulator.figures``) so the bench module stays importable where matplotlib is not
installed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdd.bench.report import ModeRun
from pdd.local.probes import throughput_mbps
from pdd.simulator.figures import pyplot, save_figure


def ttft_cdf(runs: Sequence[ModeRun], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        ttft = sorted(o.ttft_s for o in run.outcomes if o.ok and o.ttft_s is not None)
        if ttft:
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=run.mode)
    ax.set_xscale("log")
    save_figure(
        plt, fig, ax, path, "TTFT CDF per mode", "time to first token (s)",
        "share of requests", grid=True,
    )  # fmt: skip


def hit_histogram(ideal: Mapping[str, float], runs: Sequence[ModeRun], path: Path) -> None:
    """The trace's per-request prefix hit (infinite cache) beside the router's per-request
    estimate of what the serving instance held (usage.cached_tokens / prompt tokens)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = [i / 20 for i in range(21)]
    series = {"trace (infinite cache)": list(ideal.values())}
    for run in runs:
        series[run.mode] = [
            o.cached_tokens / o.prompt_tokens
            for o in run.outcomes
            if o.ok and o.cached_tokens is not None and o.prompt_tokens
        ]
    for label, values in series.items():
        if values:
            ax.hist(values, bins=bins, histtype="step", label=label, density=True)
    save_figure(
        plt, fig, ax, path, "Prefix hit ratio per request", "per-request prefix hit ratio",
        "density", grid=False,
    )  # fmt: skip


def wan_throughput(runs: Sequence[ModeRun], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        points = throughput_mbps(run.wan_series)
        if points:
            ax.plot([t for t, _ in points], [v for _, v in points], label=run.mode)
    save_figure(
        plt, fig, ax, path, "WAN link throughput over time", "time since replay start (s)",
        "WAN throughput (Mbit/s)", grid=True,
    )  # fmt: skip


#: Shading of a ``--link-schedule`` phase by what the line did: cut, slower or faster
#: than the first phase's rate.
_PHASE_COLOURS = {"cut": "tab:red", "slower": "tab:orange", "faster": "tab:green"}


def ttft_over_time(runs: Sequence[ModeRun], path: Path) -> None:
    """Each request's TTFT at the time it was sent, per mode, the link's phases shaded
    (a failed request is an x at the top)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    phases = next((r.link_phases for r in runs if r.link_phases), [])
    _shade_phases(ax, phases, max((o.sent_at for r in runs for o in r.outcomes), default=0.0))
    top = max((o.ttft_s or 0.0 for r in runs for o in r.outcomes), default=1.0) * 1.1
    for run in runs:
        ok = [(o.sent_at, o.ttft_s) for o in run.outcomes if o.ok and o.ttft_s is not None]
        failed = [o.sent_at for o in run.outcomes if o.error is not None]
        points = ax.scatter([t for t, _ in ok], [v for _, v in ok], s=6, label=run.mode)
        if failed:
            colour = points.get_facecolor()[0]
            ax.scatter(failed, [top] * len(failed), marker="x", color=colour,
                       label=f"{run.mode} failed")  # fmt: skip
    ax.set_yscale("log")
    save_figure(plt, fig, ax, path, "TTFT over time, link phases shaded", "replay time (s)",
                "TTFT (s)", grid=True)  # fmt: skip


def _shade_phases(ax: Any, phases: Sequence[dict[str, Any]], end: float) -> None:
    """Shade each phase whose line differs from the first's (the declared rate)."""
    base = phases[0]["phase"]["gbps"] if phases else None
    for p in phases:
        gbps = p["phase"]["gbps"]
        if gbps == base:
            continue
        kind = "cut" if gbps is None else "slower" if base and gbps < base else "faster"
        label = "cut" if gbps is None else f"{gbps:g} Gbit/s"
        stop = p["ended_s"] if p["ended_s"] is not None else end
        ax.axvspan(p["began_s"], stop, color=_PHASE_COLOURS[kind], alpha=0.15, label=label)


def link_view_over_time(runs: Sequence[ModeRun], path: Path) -> None:
    """What each router decided on, over the run: the line's goodput, the relay's queue
    per request ahead, and P's prefill rate (the live view learns them; the static view
    holds the declared goodput and learns nothing), the phases shaded."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True)
    phases = next((r.link_phases for r in runs if r.link_phases), [])
    end = max((v["t"] or 0.0 for r in runs for v in r.link_view), default=0.0)
    rows = (
        ("goodput_gbps", "goodput (Gbit/s)", True),
        ("relay_slot_s", "relay queue per request (s)", False),
        ("prefill_tokens_per_s", "P prefill (tokens/s)", True),
    )
    for ax, (key, label, log) in zip(axes, rows, strict=True):
        _shade_phases(ax, phases, end)
        for run in runs:
            points = [(v["t"], v[key]) for v in run.link_view if v[key] is not None]
            if points:
                ax.plot([t for t, _ in points], [y for _, y in points], label=run.mode)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small")
    axes[0].set_title("The router's link view over time, link phases shaded")
    axes[-1].set_xlabel("replay time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(ideal: Mapping[str, float], runs: Sequence[ModeRun], out_dir: Path) -> list[Path]:
    paths = [out_dir / "ttft_cdf.png", out_dir / "hit_ratio.png", out_dir / "wan_throughput.png"]
    ttft_cdf(runs, paths[0])
    hit_histogram(ideal, runs, paths[1])
    wan_throughput(runs, paths[2])
    if any(r.link_phases for r in runs):
        paths.append(out_dir / "ttft_over_time.png")
        ttft_over_time(runs, paths[-1])
    if any(r.link_view for r in runs):
        paths.append(out_dir / "link_view_over_time.png")
        link_view_over_time(runs, paths[-1])
    return paths
