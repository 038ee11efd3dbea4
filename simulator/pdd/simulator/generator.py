"""A synthetic agentic workload: closed-loop multi-turn sessions with a skewed hit-rate
distribution (:mod:`pdd.simulator.hit_mix`) plus a small class of long-input,
short-output requests.

A session's next turn goes out a think time after the previous answer, as agentic and
chat clients do, so its prompt can only hit a cache that already holds the previous
turn. Sessions start as a Poisson process at ``rate_rps / mean_turns`` (anomalous
requests arrive on their own), so in steady state the request rate is ``rate_rps``
whatever the service time (Little's law: slow service stretches sessions, not their
count of turns).

The hit targets govern the turns that *have* a previous turn. A session's first turn
and the anomalous long-input requests are cold (only the shared prefix can hit), so the
whole trace's mean is lower by that share (``GeneratorSpec.expected_mean_hit``, in the
trace's notes); :func:`pdd.simulator.workload.describe` reports what was realized.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdd.local.traces.base import Chain, Trace, TraceRequest
from pdd.simulator.hit_mix import HIGH_PERCENT, HitMix, clamp, share_range

#: ``for_mean_hit``'s share above 95% is mean ** this: 0.90 -> 0.75 (the technique's
#: figure), 0.93 -> 0.82 (the claude-code traces measure 0.85), 0.5 -> 0.15.
_SKEW_EXPONENT = math.log(0.75) / math.log(0.90)
#: z-score of the 90th percentile, to turn (median, p90) into a lognormal's sigma.
_Z90 = 1.2815515655446004
#: All generated ids share one namespace, so the shared prefix is the same ids everywhere.
NAMESPACE = "gen"


class GeneratorSpec(BaseModel):
    """Synthetic agentic traffic: multi-turn sessions with a skewed hit-rate distribution
    plus a small class of long-input, short-output requests (those arrive open loop)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["generator"] = "generator"
    rate_rps: float = Field(
        default=10.0, gt=0, description="total arrival rate (Poisson), requests/s"
    )
    duration_s: float = Field(default=600.0, gt=0, description="arrivals fall in [0, duration_s)")
    seed: int = Field(
        default=0, description="the whole trace is a function of the spec and this seed"
    )
    block_size: int = Field(default=512, ge=1, description="tokens per hash block")
    mean_turns: float = Field(
        default=20.0, ge=1, description="mean requests per session (geometric)"
    )
    mean_think_s: float = Field(
        default=30.0, gt=0, description="mean client think time from an answer to the next turn"
    )
    expected_answer_s: float = Field(
        default=20.0,
        ge=0,
        description="expected seconds from a turn to its answer; only sizes the sessions "
        "already running at t=0 and where a session's turns stop, so the window starts and "
        "ends in steady state",
    )
    input_median_tokens: int = Field(
        default=32768, ge=1, description="session context length, median"
    )
    input_p90_tokens: int = Field(default=98304, ge=1, description="session context length, p90")
    max_input_tokens: int = Field(default=200_000, ge=1, description="input lengths clamp to this")
    output_median_tokens: int = Field(
        default=230, ge=1, description="output length, lognormal median"
    )
    output_p90_tokens: int = Field(default=800, ge=1, description="output length, p90")
    max_output_tokens: int = Field(default=4096, ge=1, description="output lengths clamp to this")
    mean_hit_rate: float = Field(
        default=0.90,
        gt=0,
        le=1,
        description="mean ideal hit of a turn against its session's last turn",
    )
    above_95_share: float = Field(
        default=0.75, ge=0, le=1, description="share of those turns hitting above 95%"
    )
    shared_prefix_tokens: int = Field(
        default=0,
        ge=0,
        description="system/tool prompt every request starts with (whole blocks count)",
    )
    anomalous_share: float = Field(
        default=0.035, ge=0, lt=1, description="share of cold long-input, short-output requests"
    )
    anomalous_input_tokens: tuple[int, int] = Field(
        default=(65536, 131072), description="their input length range (uniform)"
    )
    anomalous_output_max_tokens: int = Field(
        default=400, ge=1, lt=500, description="their output is uniform in [1, this]"
    )

    @model_validator(mode="after")
    def _consistent(self) -> GeneratorSpec:
        lo, hi = self.anomalous_input_tokens
        checks = [
            (
                self.input_p90_tokens >= self.input_median_tokens,
                f"input_p90_tokens ({self.input_p90_tokens}) is below input_median_tokens "
                f"({self.input_median_tokens})",
            ),
            (
                self.output_p90_tokens >= self.output_median_tokens,
                f"output_p90_tokens ({self.output_p90_tokens}) is below output_median_tokens "
                f"({self.output_median_tokens})",
            ),
            (
                self.max_input_tokens >= self.block_size,
                f"max_input_tokens ({self.max_input_tokens}) is below one block "
                f"(block_size {self.block_size})",
            ),
            (
                self.block_size <= lo <= hi <= self.max_input_tokens,
                f"anomalous_input_tokens ({lo}, {hi}) must be ordered and within [block_size, "
                f"max_input_tokens] = [{self.block_size}, {self.max_input_tokens}]",
            ),
            (
                self.anomalous_output_max_tokens <= self.max_output_tokens,
                f"anomalous_output_max_tokens ({self.anomalous_output_max_tokens}) is above "
                f"max_output_tokens ({self.max_output_tokens})",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.hit_mix()
        return self

    def hit_mix(self) -> HitMix:
        return HitMix.solve(self.mean_hit_rate, self.above_95_share)

    @property
    def session_rate(self) -> float:
        """New sessions per second, so that all turns plus anomalous requests make rate_rps."""
        return self.rate_rps * (1 - self.anomalous_share) / self.mean_turns

    @property
    def cold_share(self) -> float:
        """Expected share of requests without a previous turn in the trace: anomalous ones,
        first turns, and the first in-window turn of sessions already running at t=0."""
        gap, turns, span = (
            self.mean_think_s + self.expected_answer_s,
            self.mean_turns,
            self.duration_s,
        )
        in_progress = (turns - 1) * gap / span * (1 - math.exp(-span / gap))
        return self.anomalous_share + self.session_rate * (1 + in_progress) / self.rate_rps

    @property
    def expected_mean_hit(self) -> float:
        """The whole trace's expected ideal mean hit (cold requests at 0, no shared prefix)."""
        return (1 - self.cold_share) * self.mean_hit_rate

    @classmethod
    def for_mean_hit(cls, mean: float, **overrides: Any) -> GeneratorSpec:
        """A spec with ``mean_hit_rate=mean`` and a share above 95% that grows with it as
        the technique's skew does (mean ** 2.73), kept within what reaches the mean."""
        lo, hi = share_range(mean)
        share = clamp(mean**_SKEW_EXPONENT, lo, hi) if 0 < mean <= 1 else 0.0
        return cls(mean_hit_rate=mean, above_95_share=share, **overrides)

    def with_mean_hit(self, mean: float) -> GeneratorSpec:
        """This spec at another mean hit rate (the bathtub sweep), via ``for_mean_hit``."""
        keep = self.model_dump(exclude={"kind", "mean_hit_rate", "above_95_share"})
        return self.for_mean_hit(mean, **keep)

    def with_rate(self, rate: float, base_dir: Path | None = None) -> GeneratorSpec:
        """This spec at ``rate`` requests/s (``base_dir``: unused, as in TraceSpec)."""
        return self.model_validate({**self.model_dump(), "rate_rps": rate})

    def build(self, base_dir: Path | None = None) -> Trace[TraceRequest]:
        """The generated trace (``base_dir``: unused, as in TraceSpec)."""
        return _Generator(self).build()


class _Generator:
    """One pass over sessions and anomalous requests. Fresh hash ids are numbered across
    the whole trace, so two requests share an id only where one copied it from the other
    (or both from the shared prefix)."""

    def __init__(self, spec: GeneratorSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.mix = spec.hit_mix()
        self.prefix = tuple(range(spec.shared_prefix_tokens // spec.block_size))
        self.next_id = len(self.prefix)
        self.input_law = _lognormal(spec.input_median_tokens, spec.input_p90_tokens)
        self.output_law = _lognormal(spec.output_median_tokens, spec.output_p90_tokens)
        self.chains: list[Chain[TraceRequest]] = []

    def build(self) -> Trace[TraceRequest]:
        s, rng = self.spec, self.rng
        # Start in steady state: sessions already running at t=0 are as many as a stationary
        # process holds, each next arrival exponential (memoryless), so the rate is flat.
        cycle = s.mean_think_s + s.expected_answer_s
        running = _poisson(rng, s.session_rate * (s.mean_turns - 1) * cycle)
        starts = [rng.expovariate(1 / cycle) for _ in range(running)]
        starts += _arrivals(rng, s.session_rate, s.duration_s)
        for i, start in enumerate(starts):
            self._session(f"s{i}", start)
        for j, t in enumerate(_arrivals(rng, s.rate_rps * s.anomalous_share, s.duration_s)):
            self._anomalous(f"a{j}", t)
        notes = (
            f"generated: {s.rate_rps:g} req/s for {s.duration_s:g} s, seed {s.seed}; "
            f"{len(starts)} closed-loop sessions ({running} running at t=0), mean "
            f"{s.mean_turns:g} turns, {s.mean_think_s:g} s think time after each answer; "
            "each session keeps its context length",
            f"hit targets (mean {s.mean_hit_rate:g}, {s.above_95_share:.0%} above 95%) hold for "
            f"turns with a previous turn; first turns and anomalous requests are cold, about "
            f"{s.cold_share:.1%}, so the trace's mean is about {s.expected_mean_hit:.3f}",
        )
        chains = tuple(sorted(self.chains, key=lambda c: c.start_s))
        return Trace(f"generator-{s.rate_rps:g}rps-seed{s.seed}", s.block_size, chains, notes)

    def _session(self, name: str, start: float) -> None:
        """One chain of turns until the session ends (after each with probability
        1/mean_turns) or its expected think and answer times pass the window. A turn with
        hit h replaces the last (1 - h) of the context, so the context keeps its block
        count and every drawn hit is realized exactly."""
        s, rng = self.spec, self.rng
        context = round(rng.lognormvariate(*self.input_law))
        blocks = clamp(context, s.block_size, s.max_input_tokens) // s.block_size
        ids: tuple[int, ...] | None = None
        turns: list[TraceRequest] = []
        think, nominal = 0.0, start
        while nominal < s.duration_s:
            ids = self._extend(self.prefix[:blocks], blocks) if ids is None else self._turn(ids)
            tokens = min(blocks * s.block_size + rng.randrange(s.block_size), s.max_input_tokens)
            turns.append(
                self._request(f"{name}#{len(turns)}", ids, tokens, self._output_tokens(), think)
            )
            if rng.random() * s.mean_turns < 1:
                break
            think = rng.expovariate(1 / s.mean_think_s)
            nominal += think + s.expected_answer_s
        self.chains.append(Chain(name, start, tuple(turns)))

    def _turn(self, previous: tuple[int, ...]) -> tuple[int, ...]:
        """The next turn's ids: the previous turn's first ``kept`` ids, then fresh ones.
        ``kept`` rounds hit x blocks stochastically (unbiased) but never out of its class."""
        n = len(previous)
        head, hit = self.mix.draw(self.rng)
        kept = int(hit * n + self.rng.random())
        if head:
            kept = max(kept, HIGH_PERCENT * n // 100 + 1)
        else:
            kept = min(kept, (HIGH_PERCENT * n - 1) // 100)
        return self._extend(previous[: max(kept, len(self.prefix))], n)

    def _anomalous(self, key: str, t: float) -> None:
        s, rng = self.spec, self.rng
        tokens = rng.randint(*s.anomalous_input_tokens)
        blocks = tokens // s.block_size
        output = rng.randint(1, s.anomalous_output_max_tokens)
        request = self._request(
            key, self._extend(self.prefix[:blocks], blocks), tokens, output, 0.0
        )
        self.chains.append(Chain(key, t, (request,)))

    def _extend(self, head: tuple[int, ...], blocks: int) -> tuple[int, ...]:
        start = self.next_id
        self.next_id += blocks - len(head)
        return head + tuple(range(start, self.next_id))

    def _output_tokens(self) -> int:
        drawn = round(self.rng.lognormvariate(*self.output_law))
        return int(clamp(drawn, 1, self.spec.max_output_tokens))

    def _request(
        self, key: str, ids: tuple[int, ...], tokens: int, output: int, think_s: float
    ) -> TraceRequest:
        return TraceRequest(key, NAMESPACE, ids, tokens, output, self.spec.block_size, think_s)


def _lognormal(median: int, p90: int) -> tuple[float, float]:
    """(mu, sigma) of the lognormal with this median and 90th percentile."""
    return math.log(median), math.log(p90 / median) / _Z90


def _arrivals(rng: random.Random, rate: float, horizon: float) -> list[float]:
    """Poisson arrival times at ``rate`` in [0, horizon)."""
    times: list[float] = []
    if rate <= 0:
        return times
    t = rng.expovariate(rate)
    while t < horizon:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson(mean) count: unit-rate arrivals before ``mean``."""
    return len(_arrivals(rng, 1.0, mean))
