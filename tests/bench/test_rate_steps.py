"""``--rate-steps``: the replay's pace stepping 1x -> 4x -> 1x, as arithmetic and as a
replay on a virtual clock (no wall-clock waits, so no dependence on machine speed)."""

from __future__ import annotations

import json

import httpx
import pytest

from pdd.bench.rate_steps import STEADY, RateSteps, RateStepsError, parse_rate_steps
from pdd.bench.replay import Replayer, ReplayTarget
from pdd.bench.synth import Job
from pdd.local.traces.base import Chain, Trace
from pdd.testing import virtual_time

pytestmark = pytest.mark.unit

BURST = RateSteps((1.0, 4.0, 1.0), 100.0)


def test_a_4x_step_replays_four_trace_seconds_per_second() -> None:
    assert [BURST.replay_at(s) for s in (0, 50, 100, 300, 500, 600)] == [
        0, 50, 100, 150, 200, 300,
    ]  # fmt: skip
    assert [BURST.trace_at(t) for t in (50, 150, 200, 300)] == [50, 300, 500, 600]
    assert [BURST.rate_at(t) for t in (0, 99, 100, 199, 200, 10_000)] == [1, 1, 4, 4, 1, 1]
    assert BURST.wait_s(40, now=90) == pytest.approx(10 + 30 / 4)  # spans the step
    assert BURST.wait_s(40, now=250) == 40
    assert [BURST.step_of(t) for t in (0, 150, 250, 9999)] == [0, 1, 2, 2]
    assert STEADY.replay_at(123.0) == 123.0 and STEADY.wait_s(5.0, 77.0) == 5.0


def test_flags_parse_and_bad_ones_say_which() -> None:
    assert parse_rate_steps(None, None) == STEADY
    assert parse_rate_steps("1,4,1", 60) == RateSteps((1.0, 4.0, 1.0), 60.0)
    assert parse_rate_steps("2", None) == RateSteps((2.0,))
    for text, step, says in [
        ("1,4,1", None, "needs --step-s"),
        (None, 60.0, "--step-s needs --rate-steps"),
        ("1,x", 60.0, "expected rates"),
        ("1,0", 60.0, "rates > 0"),
        ("1,4", 0.0, "--step-s must be > 0"),
    ]:
        with pytest.raises(RateStepsError, match=says):
            parse_rate_steps(text, step)


def answer(request: httpx.Request) -> httpx.Response:
    frame = {"choices": [{"index": 0, "text": "A", "finish_reason": "length"}]}
    return httpx.Response(200, content=f"data: {json.dumps(frame)}\n\ndata: [DONE]\n\n".encode())


def job(key: str, think_s: float = 0.0) -> Job:
    return Job(key, (1, 2, 3), max_tokens=1, think_s=think_s, fits=True)


def test_sessions_and_think_times_are_paced_by_the_step_they_begin_in() -> None:
    """Sessions at trace 0, 100 and 400 s go out at 0, 100 and 175 s; a think of 40 trace
    seconds begun at 80 s ends at 105 s (20 s at 1x, then 20 trace s at 4x)."""
    chains = (
        Chain("a", 0.0, (job("a#0"),)),
        Chain("b", 100.0, (job("b#0"),)),
        Chain("c", 400.0, (job("c#0"),)),
        Chain("d", 80.0, (job("d#0"), job("d#1", think_s=40.0))),
    )
    target = ReplayTarget("http://router/v1", "tiny")

    async def replay() -> dict[str, float]:
        replayer = Replayer(target, transport=httpx.MockTransport(answer), pace=BURST)
        outcomes = await replayer.run(Trace("t", 64, chains))
        assert all(o.ok for o in outcomes)
        return {o.key: o.sent_at for o in outcomes}

    sent = virtual_time.run(replay())
    assert sent == pytest.approx({"a#0": 0.0, "b#0": 100.0, "c#0": 175.0, "d#0": 80.0,
                                  "d#1": 105.0})  # fmt: skip
