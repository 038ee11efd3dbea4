"""``pdd bench --rate-steps 1,4,1 --step-s 60``: replay a trace at a rate that steps.

The replay's clock runs at ``rates[i]`` times the trace's own pace during the i-th
``step_s`` seconds of the replay (the last rate holds after the last step): sessions
that start in a 4x step arrive four times as densely, and a client's think time that
begins in one is a quarter as long. So a bursty replay against ``--autoscale`` loads the
stack 1x, then 4x, then 1x again, from the same trace; each request's prompt and output
are the trace's, only when it is sent changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class RateStepsError(ValueError):
    """A ``--rate-steps``/``--step-s`` that cannot pace a replay; the message says why."""


@dataclass(frozen=True)
class RateSteps:
    """Replay speed (trace seconds per replay second) over replay time."""

    rates: tuple[float, ...] = (1.0,)
    step_s: float = math.inf

    def __post_init__(self) -> None:
        if not self.rates or not all(math.isfinite(r) and r > 0 for r in self.rates):
            raise RateStepsError(f"--rate-steps must be rates > 0, got {self.rates}")
        if not self.step_s > 0:
            raise RateStepsError(f"--step-s must be > 0, got {self.step_s}")

    def rate_at(self, t: float) -> float:
        """The rate at replay time ``t``."""
        if t < 0 or math.isinf(self.step_s):
            return self.rates[0]
        return self.rates[min(int(t // self.step_s), len(self.rates) - 1)]

    def trace_at(self, t: float) -> float:
        """Trace seconds replayed by replay time ``t`` (the rate's integral)."""
        done, start = 0.0, 0.0
        for i, rate in enumerate(self.rates):
            end = math.inf if i == len(self.rates) - 1 else start + self.step_s
            if t <= end:
                return done + (t - start) * rate
            done, start = done + (end - start) * rate, end
        raise AssertionError("the last step holds for ever")

    def replay_at(self, trace_s: float) -> float:
        """The replay time by which ``trace_s`` trace seconds have been replayed."""
        done, start = 0.0, 0.0
        for i, rate in enumerate(self.rates):
            end = math.inf if i == len(self.rates) - 1 else start + self.step_s
            span = (end - start) * rate
            if trace_s <= done + span:
                return start + (trace_s - done) / rate
            done, start = done + span, end
        raise AssertionError("the last step holds for ever")

    def wait_s(self, trace_gap_s: float, now: float) -> float:
        """How long, from replay time ``now``, a gap of ``trace_gap_s`` trace seconds lasts."""
        return self.replay_at(self.trace_at(now) + trace_gap_s) - now

    def document(self) -> dict[str, object]:
        """For results.json (no infinity: JSON has none)."""
        return {
            "rates": list(self.rates),
            "step_s": self.step_s if self.step_s < math.inf else None,
        }

    def step_of(self, t: float) -> int:
        """Which step replay time ``t`` falls in (the last holds on)."""
        if math.isinf(self.step_s):
            return 0
        return min(max(0, int(t // self.step_s)), len(self.rates) - 1)


#: The trace's own pace throughout.
STEADY = RateSteps()


def parse_rate_steps(text: str | None, step_s: float | None) -> RateSteps:
    """``--rate-steps 1,4,1`` and ``--step-s 60``; STEADY without ``--rate-steps``."""
    if text is None:
        if step_s is not None:
            raise RateStepsError("--step-s needs --rate-steps")
        return STEADY
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise RateStepsError(f"--rate-steps {text!r}: expected rates like 1,4,1") from None
    if len(rates) > 1 and step_s is None:
        raise RateStepsError("--rate-steps with more than one rate needs --step-s")
    return RateSteps(rates, math.inf if step_s is None else step_s)
