"""``bench/router.py --stub-workers``: its arithmetic (unit) and one tiny run (integration).

The figures themselves are benchmarks (docs/router-scale.md), not tests; what is checked
here is that the costs are computed from the right quantities (CPU less the polls' share,
per request and per extra streamed token), that the workload gives a perfect router the hit
rate the bench says it would, and that a run over real processes answers every request and
writes the keys the issue asks for.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.common.block_hash import block_hashes
from pdd.local.manifests import find_program

BENCH = Path(__file__).parents[2] / "bench"
if str(BENCH) not in sys.path:  # bench/ scripts import each other as top-level modules
    sys.path.insert(0, str(BENCH))
load = importlib.import_module("stub_worker_load")


def step(ok: int, cpu_s: float, idle_s: float = 0.0, tokens: int = 16, **kw) -> object:
    s = load.StepResult(offered_rps=10.0, stream=True, max_tokens=tokens, wall_s=1.0, **kw)
    s.ok, s.router_cpu_s, s.idle_cpu_s = ok, cpu_s, idle_s
    return s


@pytest.mark.unit
def test_the_requests_cost_is_the_cpu_less_what_the_polls_cost() -> None:
    s = step(ok=100, cpu_s=0.5, idle_s=0.1)
    assert s.request_cpu_s == pytest.approx(0.4)
    assert s.summary()["cpu_us_per_request"] == pytest.approx(4000.0)
    assert s.summary()["cpu_us_per_request_with_polls"] == pytest.approx(5000.0)
    assert load.per_core_rate(s.ok, s.request_cpu_s) == pytest.approx(250.0)
    assert math.isnan(load.cpu_us_per(1.0, 0)) and math.isnan(load.per_core_rate(5, 0.0))
    assert step(ok=1, cpu_s=0.1, idle_s=0.5).request_cpu_s == 0.0  # never negative


@pytest.mark.unit
def test_the_token_cost_is_the_growth_per_extra_token() -> None:
    short = step(ok=10, cpu_s=0.15, idle_s=0.05, tokens=16)  # 10 ms a request
    long = step(ok=10, cpu_s=0.25, idle_s=0.05, tokens=116)  # 20 ms a request
    assert load.streamed_token_cost(short, long) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="more tokens"):
        load.streamed_token_cost(long, short)


@pytest.mark.unit
def test_a_step_keeps_up_only_with_nothing_failed_dropped_or_left_behind() -> None:
    assert step(ok=10, cpu_s=1.0).keeps_up
    assert not step(ok=8, cpu_s=1.0).keeps_up  # 80% of the offered 10
    assert not step(ok=10, cpu_s=1.0, failed=1).keeps_up
    assert not step(ok=10, cpu_s=1.0, dropped=1).keeps_up
    steps = [step(ok=5, cpu_s=1.0), step(ok=9, cpu_s=1.0), step(ok=7, cpu_s=1.0)]
    assert load.busiest(steps) is steps[1]


@pytest.mark.unit
def test_spread_and_quality_come_from_the_stats_moved_during_the_run() -> None:
    assert load.spread([3, 3, 3]) == {"max_over_mean": 1.0, "cv": 0.0}
    assert load.spread([4, 0, 0, 0])["max_over_mean"] == 4.0
    assert math.isnan(load.spread([0, 0])["cv"])
    zero = {"requests": 0, "prompt_tokens": 0, "hit_tokens": 0}
    before = {"p0": zero, "m0": {"requests": 5, "prompt_tokens": 500, "hit_tokens": 500},
              "m1": zero}  # fmt: skip
    after = {"p0": {"requests": 2, "prompt_tokens": 200, "hit_tokens": 50},
             "m0": {"requests": 7, "prompt_tokens": 700, "hit_tokens": 600},
             "m1": {"requests": 2, "prompt_tokens": 200, "hit_tokens": 0}}  # fmt: skip
    quality = load.decision_quality(before, after, {"p0": "prefill", "m0": "main", "m1": "main"})
    assert quality["prefill"]["prefix_hit_rate"] == 0.25
    assert quality["main"]["prefix_hit_rate"] == 0.25  # (100 + 0) / (200 + 200)
    assert quality["main"]["requests"] == 4
    assert quality["main"]["load_spread"]["max_over_mean"] == 1.0


@pytest.mark.unit
def test_turns_extend_their_conversation_and_conversations_share_no_block() -> None:
    talk = load.Conversations(count=3, first_chars=40, turn_chars=16, max_turns=2, seed=1)
    prompts = [talk.next_prompt() for _ in range(30)]
    by_conversation: dict[str, list[str]] = {}
    for p in prompts:
        by_conversation.setdefault(p[: p.index(":")], []).append(p)
    for name, turns in by_conversation.items():
        assert [len(t) for t in turns] == [40, 56][: len(turns)]  # a new name after 2 turns
        assert all(b.startswith(a) for a, b in itertools.pairwise(turns)), name
    firsts = {block_hashes(list(p.encode()), 16)[0] for p in prompts}
    assert len(firsts) == len(by_conversation)


@pytest.mark.unit
def test_the_ideal_hit_counts_earlier_turns_whole_blocks_only() -> None:
    prompts = ["a: " + "x" * 30, "a: " + "x" * 46, "b: " + "y" * 13]  # 33, 49, 16 tokens
    assert load.ideal_hit_rate(prompts, 16) == pytest.approx(32 / 98)
    # a warm-up's prompts count as held, not as requests
    assert load.ideal_hit_rate(prompts, 16, counted_from=1) == pytest.approx(32 / 65)


@pytest.mark.integration
def test_a_tiny_run_answers_every_request_and_writes_the_figures(tmp_path: Path) -> None:
    if find_program("redis-server") is None:
        pytest.skip("redis-server is neither on the PATH nor in the venv")
    out = tmp_path / "router.json"
    argv = [sys.executable, str(BENCH / "router.py"), "--stub-workers", "2", "--rates", "4",
            "--duration", "1", "--max-tokens", "4", "--long-tokens", "12",
            "--token-phase-rps", "4", "--ttft-requests", "2", "--open-streams", "2",
            "--idle-seconds", "0.2", "--router-replicas", "1", "2", "--json", str(out)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in ("routed_requests_per_core_s", "cpu_us_per_request", "cpu_us_per_streamed_token"):
        assert isinstance(result[key], float), key
    assert set(result["replicas"]) == {"1", "2"}
    one = result["replicas"]["1"]
    steps = one["plain_steps"] + one["stream_steps"]
    steps += [one["token_cost_steps"]["short"], one["token_cost_steps"]["long"]]
    steps += result["replicas"]["2"]["plain_steps"]
    for s in steps:
        assert (s["failed"], s["dropped"], s["ok"]) == (0, 0, s["sent"]), s
    assert one["token_cost_steps"]["long"]["tokens"] == 12 * one["token_cost_steps"]["long"]["ok"]
    assert {"p50", "p99"} <= set(one["ttft"])
    assert {"kib_per_open_stream", "streams_open_at_workers"} <= set(one["memory"])
    assert one["decision_quality"]["main"]["requests"] == one["plain_steps"][0]["ok"]
