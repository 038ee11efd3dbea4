"""The workload generator and trace specs: the hit-rate skew, closed-loop sessions, the
anomalous class, determinism, and both recorded trace formats."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from pdd.local.traces.base import Chain, Trace, TraceRequest, ideal_hit_ratios
from pdd.simulator.generator import GeneratorSpec
from pdd.simulator.hit_mix import HitMix
from pdd.simulator.workload import (
    TraceSpec,
    WorkloadError,
    WorkloadSpec,
    describe,
    offered_rate,
)

pytestmark = pytest.mark.unit

#: The trace sample committed with the repository (bench/traces/README.md).
SAMPLE = Path(__file__).resolve().parents[2] / "bench" / "traces"

#: 600 s at 20 rps: ~12k requests, ~10k turns with a history.
BIG = {"rate_rps": 20.0, "duration_s": 600.0, "seed": 7}


def _requests(trace: Trace[TraceRequest]) -> dict[str, TraceRequest]:
    return {r.key: r for r in trace.walk()}


def _previous_turn(key: str) -> str | None:
    """``s17#3`` -> ``s17#2``; None for first turns and anomalous requests."""
    session, _, turn = key.partition("#")
    return f"{session}#{int(turn) - 1}" if turn and int(turn) > 0 else None


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module", params=[0.5, 0.9])
def generated(request: pytest.FixtureRequest) -> tuple[GeneratorSpec, Trace[TraceRequest]]:
    spec = GeneratorSpec.for_mean_hit(request.param, **BIG)
    return spec, spec.build()


def test_turns_with_history_hit_the_targets(
    generated: tuple[GeneratorSpec, Trace[TraceRequest]],
) -> None:
    spec, trace = generated
    hits = ideal_hit_ratios(trace)
    warm = [h for key, h in hits.items() if _previous_turn(key)]
    assert len(warm) > 8000
    assert sum(warm) / len(warm) == pytest.approx(spec.mean_hit_rate, abs=0.03)
    above = sum(h > 0.95 for h in warm) / len(warm)
    assert above == pytest.approx(spec.above_95_share, abs=0.05)
    # the cold requests lower the whole trace's mean by the documented share
    assert describe(trace)["ideal_mean_hit"] == pytest.approx(spec.expected_mean_hit, abs=0.03)
    cold = len(hits) - len(warm)
    assert cold / len(hits) == pytest.approx(spec.cold_share, abs=0.03)


@pytest.fixture(scope="module")
def big() -> tuple[GeneratorSpec, Trace[TraceRequest]]:
    """The default generator at 20 req/s for ten minutes, built once for the module."""
    spec = GeneratorSpec(**BIG)
    return spec, spec.build()


def test_anomalous_requests_are_cold_long_input_short_output(
    big: tuple[GeneratorSpec, Trace[TraceRequest]],
) -> None:
    spec, trace = big
    hits = ideal_hit_ratios(trace)
    anomalous = [r for r in trace.walk() if r.key.startswith("a")]
    assert len(anomalous) / len(trace) == pytest.approx(spec.anomalous_share, abs=0.01)
    lo, hi = spec.anomalous_input_tokens
    assert all(lo <= r.input_tokens <= hi for r in anomalous)
    assert all(1 <= r.output_tokens <= spec.anomalous_output_max_tokens < 500 for r in anomalous)
    assert all(hits[r.key] == 0.0 for r in anomalous)
    # describe's class also counts long-context session turns with short answers
    assert describe(trace)["anomalous_share"] >= len(anomalous) / len(trace)


def test_closed_loop_sessions_at_the_rate_and_valid_requests(
    big: tuple[GeneratorSpec, Trace[TraceRequest]],
) -> None:
    spec, trace = big
    starts = [c.start_s for c in trace.chains]
    assert starts == sorted(starts)
    assert starts[0] >= 0 and starts[-1] < spec.duration_s
    assert len(trace) / spec.duration_s == pytest.approx(spec.rate_rps, rel=0.1)
    assert offered_rate(trace) == pytest.approx(spec.rate_rps, rel=0.1)
    sessions = [c for c in trace.chains if c.name.startswith("s")]
    anomalous = [c for c in trace.chains if c.name.startswith("a")]
    assert all(len(c.requests) == 1 for c in anomalous)
    turns = sum(len(c.requests) for c in sessions) / len(sessions)
    assert 3 < turns <= spec.mean_turns  # geometric, cut where think times pass the window
    for chain in sessions:  # each turn waits for the previous answer, then thinks
        assert chain.requests[0].think_s == 0.0
        assert all(r.think_s > 0 for r in chain.requests[1:])
    thinks = [r.think_s for c in sessions for r in c.requests[1:]]
    assert sum(thinks) / len(thinks) == pytest.approx(spec.mean_think_s, rel=0.1)
    requests = list(trace.walk())
    assert len({r.key for r in requests}) == len(requests)
    for r in requests:
        assert len(r.hash_ids) == r.input_tokens // spec.block_size >= 1
        assert spec.block_size <= r.input_tokens <= spec.max_input_tokens
        assert 1 <= r.output_tokens <= spec.max_output_tokens
        assert (r.namespace, r.block_size) == ("gen", spec.block_size)


def test_a_turn_shares_exactly_its_hit_with_the_previous_turn() -> None:
    spec = GeneratorSpec(rate_rps=5.0, duration_s=600.0, shared_prefix_tokens=4 * 512, seed=3)
    trace = spec.build()
    requests = _requests(trace)
    hits = ideal_hit_ratios(trace)
    first = trace.chains[0].requests[0].key
    checked = 0
    for key, r in requests.items():
        n = len(r.hash_ids)
        assert r.hash_ids[: min(4, n)] == tuple(range(min(4, n)))  # the shared prefix
        previous = _previous_turn(key)
        if previous is None:  # cold: only the shared prefix hits (once someone sent it)
            assert round(hits[key] * n) == (min(4, n) if key != first else 0)
            continue
        prev = requests[previous]
        assert len(prev.hash_ids) == n  # a session keeps its context length
        # everything past what was copied is fresh: the ideal hit is the copied prefix
        assert round(hits[key] * n) == _common_prefix(prev.hash_ids, r.hash_ids)
        checked += 1
    assert checked > 2000


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    spec = GeneratorSpec(rate_rps=5.0, duration_s=120.0, seed=11)
    assert spec.build() == spec.build()
    other = GeneratorSpec(rate_rps=5.0, duration_s=120.0, seed=12).build()
    assert [c.start_s for c in other.chains] != [c.start_s for c in spec.build().chains]


def test_unreachable_mean_names_the_fields_and_the_fix() -> None:
    with pytest.raises(ValidationError) as err:
        GeneratorSpec(mean_hit_rate=0.99, above_95_share=0.1)
    message = str(err.value)
    assert "mean_hit_rate 0.99" in message and "above_95_share 0.1" in message
    assert "for_mean_hit" in message
    with pytest.raises(ValidationError, match="mean_hit_rate must be in"):
        GeneratorSpec(mean_hit_rate=0.9999, above_95_share=1.0)
    with pytest.raises(ValidationError, match="anomalous_input_tokens"):
        GeneratorSpec(anomalous_input_tokens=(131072, 65536))
    with pytest.raises(ValidationError, match="rate_rps"):
        GeneratorSpec().with_rate(0.0)


def test_hit_mix_reaches_its_mean_keeping_the_head_uniform_when_it_can() -> None:
    default = HitMix.solve(0.9, 0.75)
    assert default.head_miss == pytest.approx(0.5)  # U(0.95, 1]
    for mean, share in [(0.9, 0.75), (0.99, 0.97), (0.05, 0.0), (0.3, 0.3), (0.96, 1.0)]:
        mix = HitMix.solve(mean, share)
        realized = share * (1 - 0.05 * mix.head_miss) + (1 - share) * 0.95 * mix.tail_fill
        assert realized == pytest.approx(mean, abs=1e-9)


def test_for_mean_hit_is_feasible_and_skewed_across_the_sweep() -> None:
    means = [0.05 + i * 0.01 for i in range(95)]
    specs = [GeneratorSpec.for_mean_hit(m, rate_rps=3.0) for m in means]
    shares = [s.above_95_share for s in specs]
    assert shares == sorted(shares)
    assert shares[0] < 0.01 and shares[-1] > 0.9
    assert GeneratorSpec.for_mean_hit(0.9).above_95_share == pytest.approx(0.75)
    assert specs[-1].rate_rps == 3.0 and specs[-1].mean_hit_rate == pytest.approx(0.99)
    moved = GeneratorSpec(seed=5, rate_rps=2.0).with_mean_hit(0.5)
    assert (moved.seed, moved.rate_rps, moved.mean_hit_rate) == (5, 2.0, 0.5)


@pytest.mark.parametrize("mean", [0.05, 0.99])
def test_sweep_ends_realize_their_mean(mean: float) -> None:
    spec = GeneratorSpec.for_mean_hit(mean, rate_rps=10.0, duration_s=600.0, seed=1)
    hits = ideal_hit_ratios(spec.build())
    warm = [h for key, h in hits.items() if _previous_turn(key)]
    assert sum(warm) / len(warm) == pytest.approx(mean, abs=0.03)


def test_workload_spec_picks_the_kind() -> None:
    adapter = TypeAdapter(WorkloadSpec)
    assert adapter.validate_python({"kind": "generator", "rate_rps": 4}) == GeneratorSpec(
        rate_rps=4
    )
    spec = adapter.validate_python({"kind": "trace", "path": "x.jsonl", "max_requests": 5})
    assert isinstance(spec, TraceSpec) and spec.path == Path("x.jsonl")
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "trace", "path": "x.jsonl", "bogus": 1})


def test_describe_counts_a_small_trace_exactly() -> None:
    def req(key: str, ids: tuple[int, ...], tokens: int, out: int) -> Chain[TraceRequest]:
        r = TraceRequest(key, "n", ids, tokens, out, 4, 0.0)
        return Chain(key, float(len(key)), (r,))

    trace = Trace(
        "t",
        4,
        (
            req("a", (1, 2, 3, 4), 16, 100),  # cold
            req("bb", (1, 2, 3, 4), 40000, 600),  # hit 1.0
            req("ccc", (1, 2, 9, 10), 50000, 499),  # hit 0.5, anomalous
        ),
    )
    d = describe(trace)
    assert d["requests"] == 3
    assert d["ideal_mean_hit"] == pytest.approx(0.5)
    assert d["share_above_95"] == pytest.approx(1 / 3)
    assert d["anomalous_share"] == pytest.approx(1 / 3)
    assert (d["input_tokens_p50"], d["output_tokens_p90"]) == (40000, 600)
    assert d["offered_rate_rps"] == pytest.approx(3 / 2)  # 3 requests over starts 1..3


def test_mooncake_slice_loads_and_scales_to_a_rate() -> None:
    spec = TraceSpec(path=Path("mooncake/conversation_trace.jsonl"), max_requests=200)
    trace = spec.build(base_dir=SAMPLE)
    assert len(trace) == 200 and trace.block_size == 512
    fast = spec.with_rate(20.0, base_dir=SAMPLE)
    scaled = fast.build(base_dir=SAMPLE)
    assert len(scaled) == 200
    assert offered_rate(scaled) == pytest.approx(20.0, rel=0.01)
    starts = [c.start_s for c in scaled.chains]
    assert len(scaled) / (max(starts) - min(starts)) == pytest.approx(20.0, rel=0.01)
    assert describe(scaled)["ideal_mean_hit"] == describe(trace)["ideal_mean_hit"]


def test_claude_code_slice_scales_think_times_with_the_rate() -> None:
    spec = TraceSpec(path=SAMPLE / "claude-code", max_requests=100, session_gap_s=60.0)
    trace = spec.build()
    assert len(trace) == 100 and trace.block_size == 64
    assert len(trace.chains) > 1  # else there would be no rate to scale
    fast = spec.with_rate(2.0)
    scaled = fast.build()
    assert offered_rate(scaled) == pytest.approx(2.0, rel=0.01)
    think = [r.think_s for r in trace.walk()]
    assert max(think) > 0
    expected = [t * fast.time_scale for t in think]
    assert [r.think_s for r in scaled.walk()] == pytest.approx(expected)


def test_trace_spec_errors_say_what_is_wrong(tmp_path: Path) -> None:
    one_session = TraceSpec(path=SAMPLE / "claude-code", max_requests=3)
    assert len(one_session.build().chains) == 1
    with pytest.raises(WorkloadError, match="no arrival rate"):
        one_session.with_rate(1.0)
    with pytest.raises(WorkloadError, match="positive"):
        one_session.with_rate(0.0)
    with pytest.raises(ValueError, match="no such file"):
        TraceSpec(path=Path("missing.jsonl")).build(base_dir=tmp_path)
