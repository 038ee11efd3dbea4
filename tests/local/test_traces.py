from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdd.bench import cli as bench
from pdd.local import traces
from pdd.local.traces import TraceFormatError, bundled_traces, detect, load_trace
from pdd.local.traces.base import ideal_hit_ratios
from pdd.local.traces.claude_code import read_json, session_files

pytestmark = pytest.mark.unit

#: The sample committed with the repository (bench/traces/README.md).
SAMPLE = Path(__file__).resolve().parents[2] / "bench" / "traces"


def test_claude_code_folder_reads_json_and_gz_with_subagents(session_dir: Path) -> None:
    trace = load_trace(session_dir, session_gap_s=30.0)
    assert detect(session_dir) == "claude-code"
    assert trace.block_size == 64
    assert [c.name for c in trace.chains] == ["s1", "s2"]
    assert [c.start_s for c in trace.chains] == [0.0, 30.0]
    s1 = trace.chains[0]
    assert [r.key for r in s1.requests] == ["s1#0", "s1#1"]
    assert [r.think_s for r in s1.requests] == [0.0, 8.0]
    (spawn,) = s1.spawns
    # starts after the first request answered (t=0 + api 2 s) plus the idle 3 s
    assert (spawn.after, spawn.delay_s) == (0, 3.0)
    assert spawn.chain.requests[0].namespace == "s1"  # subagents share the session's ids
    assert len(trace) == 6


def test_limit_keeps_whole_chains_first_then_cuts(session_dir: Path) -> None:
    trace = load_trace(session_dir)
    cut = trace.limit(4)
    assert len(cut) == 4
    assert [len(list(c.walk())) for c in cut.chains] == [3, 1]
    assert cut.limit(None) is cut


def test_a_limited_load_reads_only_the_sessions_it_needs(session_dir: Path) -> None:
    whole = load_trace(session_dir)
    for n in (1, 3, 4, 6, 99):
        assert load_trace(session_dir, max_requests=n).chains == whole.limit(n).chains
    # Three requests fit in the first session: the second file is never read.
    (session_dir / "trace_0002.json").write_text("{broken")
    assert len(load_trace(session_dir, max_requests=3)) == 3
    with pytest.raises(TraceFormatError):
        load_trace(session_dir, max_requests=4)


def test_mooncake_requests_are_open_loop_chains(mooncake_file: Path) -> None:
    trace = load_trace(mooncake_file)
    assert detect(mooncake_file) == "mooncake"
    assert trace.block_size == 512
    assert [c.start_s for c in trace.chains] == [0.0, 0.5, 1.5]
    assert all(len(c.requests) == 1 for c in trace.chains)
    hits = ideal_hit_ratios(trace)
    assert hits == {"conv#0": 0.0, "conv#1": 0.5, "conv#2": 1.0}


def test_bad_files_raise_typed_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:1"):
        load_trace(bad)
    with pytest.raises(TraceFormatError, match="no such file"):
        load_trace(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceFormatError, match=r"no \.json"):
        load_trace(empty)


def _raw_request_count(requests: list[dict]) -> int:
    """Requests in a session file's ``requests`` list, subagents' included, read from
    the JSON directly (not through the loader under test)."""
    return sum(
        _raw_request_count(r["requests"]) if r.get("type") == "subagent" else 1 for r in requests
    )


def test_the_bundled_sample_is_where_the_tools_look() -> None:
    assert bundled_traces() == SAMPLE
    assert bench.trace_path(bench.build_parser().parse_args([])) == SAMPLE / "claude-code"
    for fmt in ("claude-code", "mooncake"):
        licence = (SAMPLE / fmt / "LICENSE").read_text().split()
        assert licence[:4] == ["Apache", "License", "Version", "2.0,"]


def test_without_the_sample_bench_says_so_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(traces, "BUNDLED_TRACES", tmp_path / "absent")
    assert bench.main(["--no-progress"]) == 2
    assert "bundled trace sample is missing" in capsys.readouterr().err


def test_bundled_claude_code_sample_loads_every_session_and_subagent() -> None:
    folder = SAMPLE / "claude-code"
    assert detect(folder) == "claude-code"
    files = session_files(folder)
    docs = [read_json(f) for f in files]
    trace = load_trace(folder, session_gap_s=60.0)
    assert trace.block_size == 64
    assert [c.name for c in trace.chains] == [d["id"] for d in docs]
    assert [c.start_s for c in trace.chains] == [60.0 * i for i in range(len(files))]
    for chain, doc in zip(trace.chains, docs, strict=True):
        assert sum(1 for _ in chain.walk()) == _raw_request_count(doc["requests"])
    spawns = [s for c in trace.chains for s in c.spawns]
    assert spawns, "the sample keeps a session with subagents"
    parents = {s.chain.name: c.name for c in trace.chains for s in c.spawns}
    for spawn in spawns:  # subagents share their session's hash ids
        assert {r.namespace for r in spawn.chain.walk()} == {parents[spawn.chain.name]}
    for r in trace.walk():  # one hash id per full 64-token input block
        assert len(r.hash_ids) == r.input_tokens // 64 and r.output_tokens >= 0
    hits = ideal_hit_ratios(trace)
    assert len(hits) == len(trace)
    # The workload PDD is built for: high prefix hits, most requests nearly all cached.
    assert sum(hits.values()) / len(hits) > 0.85
    assert sum(h > 0.95 for h in hits.values()) > len(hits) / 2


def test_bundled_mooncake_sample_keeps_arrival_times_and_low_hits() -> None:
    path = SAMPLE / "mooncake" / "conversation_trace.jsonl"
    assert detect(path) == "mooncake"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    trace = load_trace(path)
    assert trace.block_size == 512 and len(trace) == len(rows)
    assert [c.start_s for c in trace.chains] == [row["timestamp"] / 1000 for row in rows]
    assert [c.start_s for c in trace.chains] == sorted(c.start_s for c in trace.chains)
    for r, row in zip(trace.walk(), rows, strict=True):
        assert r.hash_ids == tuple(row["hash_ids"])
        assert (r.input_tokens, r.output_tokens) == (row["input_length"], row["output_length"])
        assert len(r.hash_ids) == math.ceil(r.input_tokens / 512)  # the last block partial
    hits = ideal_hit_ratios(trace)
    assert hits[trace.chains[0].name] == 0.0
    # The low-hit end of the spectrum: far below the agentic sessions.
    assert sum(hits.values()) / len(hits) < 0.5
    assert sum(h > 0.95 for h in hits.values()) < len(hits) / 10


def test_a_limited_load_of_the_sample_cuts_whole_sessions_first() -> None:
    folder = SAMPLE / "claude-code"
    whole = load_trace(folder)
    first = sum(1 for _ in whole.chains[0].walk())
    cut = load_trace(folder, max_requests=first + 1)
    assert len(cut) == first + 1
    assert [sum(1 for _ in c.walk()) for c in cut.chains] == [first, 1]
    assert cut.chains[0] == whole.chains[0]
