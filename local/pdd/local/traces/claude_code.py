"""Agentic coding sessions (``claude-code/``): one JSON (or .json.gz) file per session.

Each file is one chain: its requests go out one after another, each after the
previous answer plus the recorded ``think_time``. A ``subagent`` entry is a nested
chain that starts, concurrently with its parent, when the parent reaches it: after
the preceding parent request answers plus whatever idle gap the trace shows between
that answer and the subagent's start. Hash ids are scoped to the session file (its
subagents share the numbering), so the file's ``id`` is the namespace.

Sessions carry no absolute start time; the loader starts session ``i`` at
``i * session_gap_s`` (trace seconds), and the bench says so.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from pdd.local.traces.base import Chain, Spawn, Trace, TraceFormatError, TraceRequest

SUFFIXES = (".json", ".json.gz")


def session_files(path: Path) -> list[Path]:
    """The session files at ``path`` (one file, or every .json/.json.gz in a folder)."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.name.endswith(SUFFIXES))
    if not files:
        raise TraceFormatError(f"{path}: no .json or .json.gz session files in this folder")
    return files


def read_json(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"{path}: not a readable JSON session file ({exc})") from exc


def load(
    path: Path, session_gap_s: float = 60.0, max_requests: int | None = None
) -> Trace[TraceRequest]:
    """Every session file at ``path``; with ``max_requests``, only the sessions (in start
    order, which is file order) that hold the first ``max_requests`` requests."""
    files = session_files(path)
    chains: list[Chain[TraceRequest]] = []
    block_size, loaded = 0, 0
    for i, file in enumerate(files):
        if max_requests is not None and loaded >= max_requests:
            break
        doc = read_json(file)
        try:
            block_size = int(doc["block_size"])
            name = str(doc.get("id") or file.name.split(".")[0])
            chains.append(_chain(doc["requests"], name, name, block_size, i * session_gap_s))
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{file}: missing or bad field {exc}") from exc
        loaded += sum(1 for _ in chains[-1].walk())
    note = (
        f"{len(chains)} sessions; sessions have no absolute start, session i starts at "
        f"i x {session_gap_s:g} s (trace time); subagents start when their parent reaches them"
    )
    return Trace(path.name, block_size, tuple(chains), (note,))


def _chain(
    entries: list[dict[str, Any]], name: str, namespace: str, block_size: int, start_s: float
) -> Chain[TraceRequest]:
    requests: list[TraceRequest] = []
    spawns: list[Spawn[TraceRequest]] = []
    answered_at = 0.0  # trace time the previous parent request's answer arrived
    for entry in entries:
        if entry["type"] == "subagent":
            sub_name = f"{name}/{entry.get('agent_id', len(spawns))}"
            child = _chain(entry["requests"], sub_name, namespace, block_size, 0.0)
            delay = max(0.0, float(entry["t"]) - answered_at) if requests else 0.0
            spawns.append(Spawn(len(requests) - 1, delay, child))
            continue
        think = float(entry.get("think_time") or 0.0) if requests else 0.0
        requests.append(
            TraceRequest(
                key=f"{name}#{len(requests)}",
                namespace=namespace,
                hash_ids=tuple(int(h) for h in entry["hash_ids"]),
                input_tokens=int(entry["in"]),
                output_tokens=int(entry["out"]),
                block_size=block_size,
                think_s=think,
            )
        )
        answered_at = float(entry["t"]) + float(entry.get("api_time") or 0.0)
    return Chain(name, start_s, tuple(requests), tuple(spawns))
