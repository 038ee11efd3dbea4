"""Small trace files written on the fly, in both formats."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest


def session_doc() -> dict:
    """A two-turn session whose second turn extends the first, plus a subagent."""
    return {
        "id": "s1",
        "block_size": 64,
        "hash_id_scope": "local",
        "tool_tokens": 100,
        "system_tokens": 50,
        "requests": [
            {"t": 0.0, "type": "n", "in": 200, "out": 32, "hash_ids": [1, 2, 3],
             "api_time": 2.0, "think_time": 0.0},
            {"type": "subagent", "t": 5.0, "agent_id": "a1", "tool_tokens": 10,
             "system_tokens": 5, "requests": [
                 {"t": 0.0, "type": "s", "in": 130, "out": 16, "hash_ids": [7, 8],
                  "api_time": 1.0, "think_time": 0.0}]},
            {"t": 10.0, "type": "n", "in": 300, "out": 64, "hash_ids": [1, 2, 3, 4],
             "api_time": 3.0, "think_time": 8.0},
        ],
    }  # fmt: skip


@pytest.fixture
def session_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "claude-code"
    folder.mkdir()
    with gzip.open(folder / "trace_0001.json.gz", "wt") as f:
        json.dump(session_doc(), f)
    other = {**session_doc(), "id": "s2"}
    (folder / "trace_0002.json").write_text(json.dumps(other))
    (folder / "LICENSE").write_text("not a trace")
    return folder


@pytest.fixture
def mooncake_file(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 600, "output_length": 20, "hash_ids": [0, 3]},
        {"timestamp": 1500, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
    ]
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path
