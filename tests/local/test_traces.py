from __future__ import annotations

from pathlib import Path

import pytest

from pdd.local.traces import TraceFormatError, detect, load_trace
from pdd.local.traces.base import ideal_hit_ratios

pytestmark = pytest.mark.unit

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"


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


@pytest.mark.skipif(not SHARED.exists(), reason="shared traces not present")
def test_shared_claude_code_session_hit_rate_is_high() -> None:
    trace = load_trace(SHARED / "claude-code" / "trace_0008.json.gz")
    hits = ideal_hit_ratios(trace)
    assert len(hits) == len(trace) > 10
    assert sum(hits.values()) / len(hits) > 0.8
