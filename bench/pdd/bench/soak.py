"""``pdd bench --soak DURATION``: the replay looped for hours, and what every process holds.

A soak replays the workload again and again (time-scaled, with the chaos schedule or
the link schedule when asked) until ``DURATION`` has passed, while a sampler reads,
every ``interval_s``: each process's resident memory and open file descriptors (from
``/proc``), each worker's live requests, held KV blocks (neither free nor only in the
prefix cache) and asyncio tasks (``/v1/pdd/debug/state``), the router's asyncio tasks
and admitted requests and API keys holding slots (``/metrics``), and the keys in Redis
where the stack uses it. Each series gets a least-squares slope (per hour) over the
samples after the warm-up; a series bounded by design (a cache with a limit, keys with
a TTL) is flat within noise. The report also counts the replays' mismatches (a greedy
output that differs from the first replay's) and their unclean failures, and checks
that live requests and held blocks are back to 0 once the replay is idle.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdd.common.wire import StateReport

#: Samples before this share of the run are the warm-up, left out of the slopes.
WARMUP_SHARE = 0.2
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds of ``90s``, ``30m``, ``1.5h`` or a plain number of seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"not a duration: {text!r} (say 90s, 30m or 1h)")
    return float(match.group(1)) * _UNITS.get(match.group(2) or "s", 1.0)


def _proc_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _proc_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _gauge(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else None


@dataclass
class ResourceSampler:
    """Samples every ``interval_s`` on its own thread (the replay owns the event loop)."""

    pids: Callable[[], Mapping[str, int]]
    workers: Mapping[str, str]  # name -> http url
    secret: str
    router_url: str
    interval_s: float
    redis_url: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _t0: float = field(default_factory=time.monotonic)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self, label: str = "") -> dict[str, Any]:
        """One row: ``series name -> value`` (None where a process did not answer)."""
        row: dict[str, Any] = {"t_s": time.monotonic() - self._t0, "label": label}
        for name, pid in self.pids().items():
            row[f"rss_mib/{name}"] = _proc_rss_mib(pid)
            row[f"open_fds/{name}"] = _proc_fds(pid)
        headers = {"Authorization": f"Bearer {self.secret}"}
        with httpx.Client(timeout=10.0, headers=headers, verify=False) as http:
            for name, url in self.workers.items():
                try:
                    s = StateReport.model_validate_json(
                        http.get(f"{url}/v1/pdd/debug/state").content
                    )
                except (httpx.HTTPError, ValueError):
                    continue
                row[f"live_requests/{name}"] = s.live_requests
                row[f"held_blocks/{name}"] = (
                    s.kv_blocks_total - s.kv_blocks_free - s.kv_blocks_cached
                )
                row[f"asyncio_tasks/{name}"] = s.asyncio_tasks
            try:
                text = http.get(f"{self.router_url}/metrics").text
                row["asyncio_tasks/router"] = _gauge(text, "pdd_router_asyncio_tasks")
                row["stream_slots/router"] = _gauge(text, "pdd_router_admitted_requests")
                row["slot_keys/router"] = _gauge(text, "pdd_router_admitted_api_keys")
            except httpx.HTTPError:
                pass
        if self.redis_url:
            row["redis_keys/redis"] = _redis_keys(self.redis_url)
        self.rows.append(row)
        return row


def _redis_keys(url: str) -> int | None:
    import redis

    try:
        return int(redis.Redis.from_url(url, socket_timeout=2).dbsize())
    except redis.RedisError:
        return None


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(seconds, value)`` points, in value per hour."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 3600.0 * sum((t - mx) * (v - my) for t, v in points) / var


def series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Each series' ``(seconds, value)`` points, Nones left out."""
    out: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        for name, value in row.items():
            if "/" in name and value is not None:
                out.setdefault(name, []).append((row["t_s"], float(value)))
    return out


def summarize(rows: list[dict[str, Any]], warmup_share: float = WARMUP_SHARE) -> dict[str, Any]:
    """Per series: first, last, min, max after the warm-up, and the slope per hour."""
    if not rows:
        return {}
    end = rows[-1]["t_s"]
    out = {}
    for name, points in series(rows).items():
        steady = [p for p in points if p[0] >= warmup_share * end] or points
        values = [v for _, v in steady]
        out[name] = {
            "first": points[0][1],
            "last": points[-1][1],
            "min": min(values),
            "max": max(values),
            "slope_per_hour": slope_per_hour(steady),
        }
    return out


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """One panel per kind of series (memory, fds, requests and blocks, tasks and slots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [
        ("rss_mib", "resident memory (MiB)"),
        ("open_fds", "open file descriptors"),
        ("live_requests", "live requests"),
        ("held_blocks", "held KV blocks"),
        ("asyncio_tasks", "asyncio tasks"),
        ("stream_slots", "router slots / keys / Redis keys"),
    ]
    data = series(rows)
    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    summary = summarize(rows)
    for ax, (kind, label) in zip(axes.flat, kinds, strict=True):
        names = [n for n in data if n.split("/")[0] == kind]
        if kind == "stream_slots":
            names += [n for n in data if n.split("/")[0] in ("slot_keys", "redis_keys")]
        for name in sorted(names):
            t = [p[0] / 60 for p in data[name]]
            slope = summary[name]["slope_per_hour"]
            tag = f"{name.split('/', 1)[1]} ({slope:+.1f}/h)" if slope is not None else name
            if kind == "stream_slots":
                tag = f"{name} ({slope:+.1f}/h)" if slope is not None else name
            ax.plot(t, [p[1] for p in data[name]], label=tag, marker=".", linewidth=1)
        ax.set_title(label)
        if names:
            ax.legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
