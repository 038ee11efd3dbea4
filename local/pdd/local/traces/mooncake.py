"""Arrival-timed traces (``mooncake/*.jsonl``): one request per line, open loop.

``{"timestamp": ms, "input_length", "output_length", "hash_ids"}`` with 512-token
prefix-chained blocks shared across the whole file (one namespace per file). Each
request is a chain of one, started at its timestamp: arrivals do not wait for answers.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdd.local.traces.base import Chain, Trace, TraceFormatError, TraceRequest

BLOCK_SIZE = 512


def trace_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.jsonl"))
    if not files:
        raise TraceFormatError(f"{path}: no .jsonl files in this folder")
    return files


def load(path: Path) -> Trace[TraceRequest]:
    chains = []
    for file in trace_files(path):
        chains += _load_file(file, namespace=file.stem)
    note = f"{len(chains)} requests at their recorded arrival times (open loop)"
    return Trace(path.name, BLOCK_SIZE, tuple(chains), (note,))


def _load_file(file: Path, namespace: str) -> list[Chain[TraceRequest]]:
    chains = []
    with file.open(encoding="utf-8") as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                request = TraceRequest(
                    key=f"{namespace}#{n}",
                    namespace=namespace,
                    hash_ids=tuple(int(h) for h in row["hash_ids"]),
                    input_tokens=int(row["input_length"]),
                    output_tokens=int(row["output_length"]),
                    block_size=BLOCK_SIZE,
                    think_s=0.0,
                )
                start = float(row["timestamp"]) / 1000.0
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{file}:{n + 1}: bad request line ({exc})") from exc
            chains.append(Chain(request.key, start, (request,)))
    return chains
