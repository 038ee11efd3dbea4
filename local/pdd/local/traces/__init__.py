"""Trace loaders: both recorded formats (agentic ``claude-code`` sessions and
arrival-timed ``mooncake`` requests) into one ``Trace`` shape.

A small sample of each is committed at ``bench/traces/`` in the checkout (its README
says where the full traces come from); ``bundled_traces()`` finds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pdd.local.traces import claude_code, mooncake
from pdd.local.traces.base import Chain, Spawn, Trace, TraceFormatError, TraceRequest

__all__ = [
    "Chain",
    "Spawn",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "bundled_traces",
    "detect",
    "load_trace",
]

Format = Literal["claude-code", "mooncake"]

#: The committed sample: ``bench/traces/`` at the checkout's root (the parent of ``local/``).
BUNDLED_TRACES = Path(__file__).resolve().parents[4] / "bench" / "traces"


def bundled_traces() -> Path:
    """The trace sample committed with the repository, ``bench/traces/``: one folder per
    format (``claude-code/``, ``mooncake/``). An installation that is not a checkout of
    the repository has none; this raises TraceFormatError saying what to do then."""
    if not BUNDLED_TRACES.is_dir():
        raise TraceFormatError(
            f"{BUNDLED_TRACES}: the bundled trace sample is missing (pdd is not running "
            "from a checkout of its repository); pass a trace file or folder explicitly"
        )
    return BUNDLED_TRACES


def detect(path: Path) -> Format:
    """``.jsonl`` (or a folder of them) is Mooncake; ``.json``/``.json.gz`` sessions otherwise."""
    if not path.exists():
        raise TraceFormatError(f"{path}: no such file or folder")
    if path.is_file():
        return "mooncake" if path.name.endswith(".jsonl") else "claude-code"
    return "mooncake" if any(path.glob("*.jsonl")) else "claude-code"


def load_trace(
    path: Path,
    fmt: Format | None = None,
    session_gap_s: float = 60.0,
    max_requests: int | None = None,
) -> Trace[TraceRequest]:
    """The trace at ``path``, cut to its first ``max_requests`` requests (whole chains in
    start order, the last one cut), reading no more of it than that needs."""
    fmt = fmt or detect(path)
    if fmt == "mooncake":
        trace = mooncake.load(path)  # open loop: any file may hold the earliest arrivals
    else:
        trace = claude_code.load(path, session_gap_s, max_requests)
    return trace.limit(max_requests)
