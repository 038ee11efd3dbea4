"""Trace loaders: both formats in ../shared/traces/ into one ``Trace`` shape."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pdd.local.traces import claude_code, mooncake
from pdd.local.traces.base import Chain, Spawn, Trace, TraceFormatError, TraceRequest

__all__ = ["Chain", "Spawn", "Trace", "TraceFormatError", "TraceRequest", "detect", "load_trace"]

Format = Literal["claude-code", "mooncake"]


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
